"""A linear over integer-group weights (GPTQ, AWQ, compressed-tensors; ir/formats/int_groups.py) kept packed on the
device: act-order inputs gathered into the stored column order first, then the DSL's GEMV (kernels_src/
int_group_gemv.py) for 1-8 rows, its tensor-core GEMM (kernels_src/int_group_gemm.py) for 9-GEMM_ROWS, and past that
W dequantized to x's dtype, a chunk of rows at a time, for cuBLAS: prefill's GEMMs are compute-bound, where cuBLAS on
the dense W is the stronger kernel and writing W once a step costs little beside them."""

from __future__ import annotations

from backends.cuda.runtime import torch
from backends.cuda.torch_ops import dequantized_matmul
from ir.weight_formats import weight_format
from kernels_src.int_group_gemm import int_group_matmul
from kernels_src.int_group_gemv import MAX_ROWS, int_group_dequantize, int_group_gemv

# The GEMM's rows: on the H200 (docs/BENCHMARKS.md) it beat dequantize + cuBLAS at 16 rows (2026-12-03: 1.1x on
# 4096x4096, 2.2x on 4096x14336) and lost at 256 (0.44x, 0.85x) as stream; as mmq (int_group_gemm.TUNED) it took
# 0.18-0.43 of dequantize + cuBLAS's time at 64 rows and 0.25-0.53 at 128 on Llama-3-8B's four shapes (2026-12-05).
GEMM_ROWS = 128


def int_group_linear(x: torch.Tensor, data: torch.Tensor, qtype: str, shape: tuple[int, int],
                     perm: torch.Tensor | None, target: str, chunk_bytes: int, pdl: bool | None = None,
                     x_i8: tuple | None = None) -> torch.Tensor:
    """y = x @ W.T for W [N, K] stored as intgroup blocks `data` (uint8 [N, row_bytes]) of format `qtype`; `pdl` as
    the runner's (None: wherever the target can); x_i8: x's int8 arrays made with x (backends/cuda/x_int8_fusion),
    no perm: quantize_x_i8's four for the GEMV, or the GEMM's mmq pre-pass (xq, xs), made only where every reader of
    x runs that variant."""
    bits, group = weight_format(qtype).int_group
    n, k = shape
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    x2 = x2.contiguous()
    given = {4: "gemv", 2: "mmq"}.get(len(x_i8)) if x_i8 is not None and perm is None else None
    if x2.shape[0] <= MAX_ROWS:
        return int_group_gemv(x2, data, bits, group, target=target, pdl=pdl,
                              x_i8=x_i8 if given == "gemv" else None).reshape(*x.shape[:-1], n)
    if x2.shape[0] <= GEMM_ROWS:
        return int_group_matmul(x2, data, bits, group, target=target, pdl=pdl,
                                x_mmq=x_i8 if given == "mmq" else None).reshape(*x.shape[:-1], n)
    dtype = str(x.dtype).removeprefix("torch.")

    def rows(r0: int, r1: int):
        return int_group_dequantize(data[r0:r1], bits, group, k, dtype=dtype, target=target)

    return dequantized_matmul(x2, n, k * x.element_size(), chunk_bytes, rows).reshape(*x.shape[:-1], n)
