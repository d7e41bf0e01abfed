"""A linear over GGUF blocks kept quantized on the device, by its rows: the dequantizing GEMV (kernels_src/
dequant_gemv, int8 x on I8_TARGETS) for few, the int8 MMQ GEMM (kernels_src/gguf_mmq) for Q4_K / Q6_K from
MMQ_MIN_ROWS, the dequantizing GEMM (kernels_src/dequant_gemm) to GEMM_MAX_ROWS, and past that (prefill) W
dequantized in chunks for a cuBLAS GEMM."""

from __future__ import annotations

from collections.abc import Callable

from backends.cuda import torch_ops
from backends.cuda.runtime import torch
from backends.cuda.weights import QuantWeight
from kernels_src.dequant_gemv import dequant_gemv
from kernels_src.dequant_gemv_i8 import I8_TARGETS
from kernels_src.gguf_mmq import MIN_ROWS as MMQ_MIN_ROWS
from kernels_src.gguf_mmq import MMQ_QTYPES, mmq

GEMV_MAX_ROWS = 8  # the dequantizing GEMV's limit; above it the dequantizing GEMM (kernels_src/dequant_gemm.py)
GEMM_MAX_ROWS = 256  # its limit: above it (prefill) weights are dequantized in chunks for a cuBLAS GEMM


def _takes_mmq(qtype: str, target: str) -> bool:
    """Whether qtype's linears on `target` have the int8 MMQ GEMM for their middle rows."""
    return qtype in MMQ_QTYPES and target in I8_TARGETS


def takes_gemv(rows: int, qtype: str, target: str) -> bool:
    """Whether a linear of `rows` rows over qtype's blocks runs the dequantizing GEMV on `target`."""
    return rows < (MMQ_MIN_ROWS[qtype] if _takes_mmq(qtype, target) else GEMV_MAX_ROWS + 1)


def takes_mmq(rows: int, qtype: str, target: str, mmq_max_rows: int) -> bool:
    """Whether it runs the int8 MMQ GEMM (mmq_max_rows: the runner's)."""
    return not takes_gemv(rows, qtype, target) and rows <= mmq_max_rows and _takes_mmq(qtype, target)


def gguf_linear(x: torch.Tensor, w: QuantWeight, target: str, *, pdl: bool | None, mmq_variant: str | None,
                mmq_max_rows: int, chunk_bytes: int, row_ids: Callable[[int, int], torch.Tensor],
                xq_d: tuple | None = None) -> torch.Tensor:
    """y = x @ W.T; mmq_variant, mmq_max_rows, pdl: the runner's; row_ids(r0, r1): int32 row indices on the device;
    xq_d: x's int8 form made with x (backends/cuda/x_int8_fusion): quantize_x's (xq, xd) for the GEMV's int8 path,
    or the MMQ's per256 pre-pass (xq, xd, xs), which the fusion makes only where every reader takes that layout."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    given = {2: "gemv", 3: "mmq"}.get(len(xq_d)) if xq_d is not None else None
    if takes_gemv(x2.shape[0], w.qtype, target):
        return dequant_gemv(x2, w.data, w.qtype, target=target, pdl=pdl,
                            xq_d=xq_d if given == "gemv" else None).reshape(*x.shape[:-1], n)
    if takes_mmq(x2.shape[0], w.qtype, target, mmq_max_rows):
        # int8 MMAs (Q4_K: 1.1-1.3x the GEMV at 4-8 rows, 1.1-1.9x dequant_gemm at 9-32 on an H200)
        return mmq(x2, w.data, w.qtype, target=target, pdl=pdl, variant=mmq_variant,
                   xq=xq_d if given == "mmq" else None).reshape(*x.shape[:-1], n)
    if x2.shape[0] <= GEMM_MAX_ROWS:  # W's blocks read once per 16-64 rows, no fp16 copy of W written
        from kernels_src.dequant_gemm import dequant_matmul

        return dequant_matmul(x2, w.data, w.qtype, target=target, pdl=pdl).reshape(*x.shape[:-1], n)
    from kernels_src.dequantize import dequantize_rows

    def rows(r0: int, r1: int):
        return dequantize_rows(w.data, row_ids(r0, r1), w.qtype, k, dtype=x.dtype, target=target, pdl=pdl)

    return torch_ops.dequantized_matmul(x2, n, k * x.element_size(), chunk_bytes, rows).reshape(*x.shape[:-1], n)
