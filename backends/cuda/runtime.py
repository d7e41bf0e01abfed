"""torch, and which DSL target runs the kernels on a given device."""

from __future__ import annotations

import torch

__all__ = ["kernel_target", "torch"]


def kernel_target(device: torch.device) -> str:
    """Triton on a GPU; Triton's interpreter on CPU tensors (slow: CI runs a tiny model end to end that way)."""
    return "triton" if device.type == "cuda" else "triton-interpret"
