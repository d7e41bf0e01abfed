"""MLX's CPU GEMMs through the OpenBLAS shim: it is loaded, and every shape and transposition that
the backend produces (including the one-row products it routes to sgemv) is computed correctly."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from backends.mlx import fast_blas
from backends.mlx.runtime import mx


@pytest.mark.skipif(platform.system() != "Linux", reason="the shim is for MLX's Linux CPU build")
def test_shim_is_loaded():
    assert fast_blas.status.startswith("OpenBLAS"), fast_blas.status


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (1, 1536, 576), (1, 7, 5), (3, 64, 33), (16, 576, 192)])
@pytest.mark.parametrize("layout", ["w_rows", "w_cols", "x_transposed"])
def test_matmul_matches_float64(m, k, n, layout):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if layout == "w_rows":  # how the backend multiplies by a [out, in] weight
        out = mx.array(x) @ mx.array(w).T
    elif layout == "w_cols":
        out = mx.array(x) @ mx.array(np.ascontiguousarray(w.T))
    else:
        out = mx.array(np.ascontiguousarray(x.T)).T @ mx.array(w).T
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)) + 1e-6
    assert np.all(np.abs(np.array(out) - ref) <= bound)
