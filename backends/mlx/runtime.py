"""The one place that imports mlx, so that the CPU build gets OpenBLAS first (see fast_blas)."""

from __future__ import annotations

import sys

from backends.mlx import fast_blas

if "mlx.core" not in sys.modules:
    fast_blas.load()

import mlx.core as mx  # noqa: E402

__all__ = ["mx", "metal_available"]


def metal_available() -> bool:
    return bool(mx.metal.is_available())
