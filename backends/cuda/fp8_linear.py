"""A linear over FP8 weights (ir/formats/fp8_blocks.py) kept as their e4m3 bytes on a device with FP8 (compute
capability 8.9 and up: Ada, Hopper), and the one place its path is chosen:
- one scale a row (per-channel and per-tensor checkpoints): torch._scaled_mm on x quantized to e4m3 row by row, as
  the checkpoints' dynamic activation scheme asks (row-wise scaling: a bf16 output, on Hopper);
- scales per block of inputs (DeepSeek-V3 / Qwen3-FP8's 128x128), 1-8 rows (decode): the DSL's GEMV over the bytes
  (kernels_src/fp8_gemv.py); also for one scale a row where _scaled_mm's row-wise scaling is not there. Per-channel
  weights keep _scaled_mm at decode: the GEMV against it is unmeasured;
- scales per block of inputs (groups a multiple of 32), 9+ rows (decode batches, prefill) on a GPU: the DSL's FP8
  GEMM (kernels_src/fp8_gemm.py): x quantized to e4m3 per row and group (the checkpoints' dynamic activation
  scheme, as vLLM runs them), one FP8 tensor-core dot a group;
- otherwise (groups of 16, CPU tensors): W dequantized to x's dtype a chunk of rows at a time (each value times its
  block's scale in fp32, then rounded once), then one GEMM.
Elsewhere (MLX, older GPUs, CPU tensors) the weights are dequantized at load: `no_fp8` says why, for the log."""

from __future__ import annotations

import functools

from backends.cuda.runtime import torch
from backends.cuda.torch_ops import dequantized_matmul
from kernels_src.fp8_gemm import fp8_matmul, step_of
from kernels_src.fp8_gemv import MAX_ROWS, fp8_gemv

MIN_CAPABILITY = (8, 9)
ROWWISE_CAPABILITY = (9, 0)  # row-wise scaled _scaled_mm: Hopper's cuBLASLt/CUTLASS path; Ada takes the blockwise one
E4M3_MAX = 448.0


def no_fp8(device: torch.device) -> str | None:
    """None where FP8 weights stay e4m3 on `device`; else why they are dequantized at load."""
    if device.type != "cuda":
        return "the CUDA backend keeps FP8 weights on a GPU only (CPU tensors)"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} has no FP8 (needs 8.9 or higher)"
    return None


def path(group: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, rows: int) -> str:
    """"scaled_mm", "gemv", "fp8_gemm" or "blockwise" for `rows` rows of x times weights [N, K] with a scale a
    `group` inputs, computed in `dtype`."""
    n, k = shape
    # On a GPU, row-wise scaling writes bf16 only, and wants Hopper; on CPU tensors (tests) any float output, where
    # this torch's CPU kernel takes row-wise scales at all.
    rowwise = cpu_rowwise() if device.type != "cuda" else (
        dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= ROWWISE_CAPABILITY)
    if group == k and k % 16 == 0 and n % 16 == 0 and rowwise:
        return "scaled_mm"
    if rows <= MAX_ROWS:
        return "gemv"
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
               pdl: bool | None = None) -> torch.Tensor:
    """y = x @ W.T for W [N, K] as e4m3 bytes `codes` (uint8 [N, K]) and f32 `scales` [N, K / group]; `target` and
    `pdl` (None: wherever the target can) as the runner's, for the GEMV."""
    n, k = codes.shape
    x2 = x.reshape(-1, k)
    how = path(k // scales.shape[1], (n, k), x.dtype, x.device, x2.shape[0])
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
