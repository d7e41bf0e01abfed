"""A linear over FP8 weights (ir/formats/fp8_blocks.py) kept as their e4m3 bytes on a device with FP8 (compute
capability 8.9 and up: Ada, Hopper), and the one place its path is chosen:
- one scale a row (per-channel and per-tensor checkpoints): torch._scaled_mm on x quantized to e4m3 row by row, as
  the checkpoints' dynamic activation scheme asks (row-wise scaling: a bf16 output, on Hopper);
- scales per block of inputs (DeepSeek-V3 / Qwen3-FP8's 128x128), 1-8 rows (decode): the DSL's GEMV over the bytes
  (kernels_src/fp8_gemv.py); also for one scale a row where _scaled_mm's row-wise scaling is not there. Per-channel
  weights keep _scaled_mm at decode: the GEMV against it is unmeasured;
- DeepSeek's 128 x 128 blocks (scales constant over each 128 rows: `block_scales`), BLOCK_MM_MIN_ROWS+ rows
  (prefill) on a GPU whose torch._scaled_mm takes them (cuBLASLt's blockwise scaling, CUDA 12.9+ on Hopper; probed
  once, `blockwise_mm`): x quantized to e4m3 per row and 128 inputs by the DSL's kernel, then one cuBLASLt call;
- scales per block of inputs (groups a multiple of 32), 9+ rows (decode batches, prefill) on a GPU: the DSL's FP8
  GEMM (kernels_src/fp8_gemm.py): x quantized to e4m3 per row and group (the checkpoints' dynamic activation
  scheme, as vLLM runs them), one FP8 tensor-core dot a group;
- otherwise (groups of 16, CPU tensors): W dequantized to x's dtype a chunk of rows at a time (each value times its
  block's scale in fp32, then rounded once), then one GEMM.
Elsewhere (MLX, older GPUs, CPU tensors) the weights are dequantized at load: `no_fp8` says why, for the log."""

from __future__ import annotations

import functools
import os

import numpy as np

from backends.cuda.runtime import torch
from backends.cuda.torch_ops import dequantized_matmul
from kernels_src.fp8_gemm import fp8_matmul, quantize_x, step_of
from kernels_src.fp8_gemv import MAX_ROWS, fp8_gemv

MIN_CAPABILITY = (8, 9)
ROWWISE_CAPABILITY = (9, 0)  # row-wise scaled _scaled_mm: Hopper's cuBLASLt/CUTLASS path; Ada takes the blockwise one
E4M3_MAX = 448.0
BLOCK = 128  # DeepSeek-V3's weight blocks: 128 rows x 128 inputs share a scale
# Rows from which 128 x 128-block weights go through cuBLASLt's blockwise-scaled GEMM rather than the DSL's FP8 GEMM
# (prefill sizes; LLM_ENGINE_FP8_BLOCK_MM=0: never): H200 figures in docs/BENCHMARKS.md (2026-12-04).
BLOCK_MM_MIN_ROWS = 0 if os.environ.get("LLM_ENGINE_FP8_BLOCK_MM", "1") == "0" else 128


def no_fp8(device: torch.device) -> str | None:
    """None where FP8 weights stay e4m3 on `device`; else why they are dequantized at load."""
    if device.type != "cuda":
        return "the CUDA backend keeps FP8 weights on a GPU only (CPU tensors)"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} has no FP8 (needs 8.9 or higher)"
    return None


def block_scales(scales: np.ndarray, k: int) -> np.ndarray | None:
    """The [N / 128, K / 128] scales of 128 x 128 blocks where f32 `scales` [N, K / 128] are constant over each 128
    rows (DeepSeek-V3 / Qwen3-FP8 checkpoints, `--isq fp8`), else None."""
    n, groups = scales.shape
    if groups * BLOCK != k or n % BLOCK:
        return None
    blocks = scales.reshape(n // BLOCK, BLOCK, groups)
    return np.ascontiguousarray(blocks[:, 0]) if (blocks == blocks[:, :1]).all() else None


@functools.cache
def blockwise_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm on `device` takes 1 x 128 scales for x and 128 x 128 ones for W, writing `dtype`
    (cuBLASLt 12.9+ on Hopper); tried once on a small problem."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != ROWWISE_CAPABILITY:
        return False
    a = torch.ones(BLOCK, 2 * BLOCK, device=device).to(torch.float8_e4m3fn)
    try:
        y = torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, BLOCK, device=device).t(),
                             scale_b=torch.ones(1, 2, device=device).t(), out_dtype=dtype)
    except (RuntimeError, ValueError, NotImplementedError):  # the op names a configuration it does not take
        return False
    return bool((y == 2 * BLOCK).all())


def path(group: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, rows: int,
         blocks: bool = False) -> str:
    """"scaled_mm", "gemv", "block_scaled_mm", "fp8_gemm" or "blockwise" for `rows` rows of x times weights [N, K]
    with a scale a `group` inputs (constant over 128-row blocks: `blocks`), computed in `dtype`."""
    n, k = shape
    # On a GPU, row-wise scaling writes bf16 only, and wants Hopper; on CPU tensors (tests) any float output, where
    # this torch's CPU kernel takes row-wise scales at all.
    rowwise = cpu_rowwise() if device.type != "cuda" else (
        dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= ROWWISE_CAPABILITY)
    if group == k and k % 16 == 0 and n % 16 == 0 and rowwise:
        return "scaled_mm"
    if rows <= MAX_ROWS:
        return "gemv"
    if blocks and BLOCK_MM_MIN_ROWS and rows >= BLOCK_MM_MIN_ROWS and blockwise_mm(device, dtype):
        return "block_scaled_mm"
    # CPU tensors (tests with the device gate opened) keep the exact dequantized product
    return "fp8_gemm" if device.type == "cuda" and step_of(group) else "blockwise"


@functools.cache
def cpu_rowwise() -> bool:
    """Whether torch._scaled_mm takes row-wise scales on CPU tensors: torch 2.13's does, 2.11's (the H200's) asserts
    that both scales are one number."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [rows, K] in `dtype` from e4m3 bytes uint8 [rows, K] and f32 scales [rows, K / group]."""
    rows, k = codes.shape
    w = codes.view(torch.float8_e4m3fn).to(torch.float32).view(rows, scales.shape[1], -1) * scales[..., None]
    return w.view(rows, k).to(dtype)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, chunk_bytes: int, target: str = "triton",
               pdl: bool | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T for W [N, K] as e4m3 bytes `codes` (uint8 [N, K]) and f32 `scales` [N, K / group] (`blocks`: the
    same as [N / 128, K / 128] where block_scales found them); `target` and `pdl` (None: wherever the target can) as
    the runner's, for the DSL's kernels."""
    n, k = codes.shape
    x2 = x.reshape(-1, k)
    how = path(k // scales.shape[1], (n, k), x.dtype, x.device, x2.shape[0], blocks is not None)
    if how == "block_scaled_mm":
        return block_scaled_mm(x2.contiguous(), codes, blocks, target, pdl).reshape(*x.shape[:-1], n)
    if how == "gemv":
        return fp8_gemv(x2.contiguous(), codes, scales, target=target, pdl=pdl).reshape(*x.shape[:-1], n)
    if how == "fp8_gemm":
        return fp8_matmul(x2.contiguous(), codes, scales, target=target, pdl=pdl).reshape(*x.shape[:-1], n)
    if how == "scaled_mm":
        xs = (x2.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_min(1e-12)
        xq = (x2.float() / xs).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, codes.view(torch.float8_e4m3fn).t(), scale_a=xs, scale_b=scales.view(1, n),
                             out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], n)
    y = dequantized_matmul(x2, n, k * 4, chunk_bytes,  # the fp32 product is the larger scratch
                           lambda r0, r1: dequantize(codes[r0:r1], scales[r0:r1], x.dtype))
    return y.reshape(*x.shape[:-1], n)


def block_scaled_mm(x2: torch.Tensor, codes: torch.Tensor, blocks: torch.Tensor, target: str,
                    pdl: bool | None) -> torch.Tensor:
    """x2 [M, K] @ W.T through torch._scaled_mm's blockwise scaling: x in e4m3 a row and 128 inputs (the DSL's
    quantize_x), its scales outer-dim-major as cuBLASLt wants them, M padded to a multiple of 4 (cuBLASLt's)."""
    m = x2.shape[0]
    xq, xs = quantize_x(x2, BLOCK, target=target, pdl=pdl)
    if pad := -m % 4:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, pad))
        xs = torch.nn.functional.pad(xs, (0, 0, 0, pad), value=1.0)
    y = torch._scaled_mm(xq.view(torch.float8_e4m3fn), codes.view(torch.float8_e4m3fn).t(),
                         scale_a=xs.t().contiguous().t(), scale_b=blocks.t(), out_dtype=x2.dtype)
    return y[:m]
