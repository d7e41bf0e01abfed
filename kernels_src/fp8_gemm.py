"""FP8 GEMM y[M, N] = x[M, K] @ W.T for 9+ rows (decode batches, prefill) over W kept as e4m3 bytes (uint8 [N, K]) with
an f32 scale per GROUP inputs of a row (f32 [N, K / GROUP]: DeepSeek-V3 / Qwen3-FP8's 128x128 blocks as the CUDA
backend keeps them), on FP8 tensor cores: DSL kernels, launcher, numpy reference.

The checkpoints' own scheme (their activation_scheme "dynamic", what vLLM's w8a8 block GEMM runs):
- fp8_quantize_x_kernel: x quantized per row and GROUP inputs to e4m3 with an f32 scale amax / 448 (x / scale
  rounded to nearest even by e4m3.encode's bit operations); no host sync, so CUDA graphs capture it. On a GPU
  Triton's fp32 `/` is div.full.f32 (2 ulp): a code may be its neighbour where x / scale lies that near a midpoint.
- fp8_gemm_kernel: a program owns a [BLOCK_M, BLOCK_N] tile of y and walks K a step of BK inputs (a power of two
  of 32-128 dividing GROUP: one x scale and one W scale a row per step). Each step is one e4m3 x e4m3 `tl.dot` into
  a fresh fp32 tile, multiplied by x_scale[row] * w_scale[n] and added to the fp32 accumulator: sm_90's FP8 MMA
  adds in fewer than fp32's bits (Triton's max_num_imprecise_acc), so a step's sum is the only imprecise one, as
  DeepSeek-V3's GEMM promotes every 128 inputs.
- SWAP (default at few rows): the dot is W [BLOCK_N, BK] @ x.T, so W is the MMA's M side (Hopper's wgmma: 64 rows
  a warpgroup) and the batch its N (16 and up). Both operands are K-major (rows of bytes), as the FP8 wgmma wants.
- Rows of x past M and of W past N are clamped (read again, not stored); split-K (small grids) shares dequant_gemm's
  fp32 partials and reduce kernel.
Targets without FP8 (the SIMT ones: C, CUDA C, Metal) refuse the kernel by name (ir.fp8_free).
"""

from __future__ import annotations

import numpy as np

from ir.formats import fp8_blocks
from kernels_src import e4m3
from kernels_src.dequant_gemm import _pow2_divisor, row_block
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.fp8_gemv import weight_group
from kernels_src.split_k import gemm_out, launch_split_k, sm_count, split_k_for, split_k_tile

MIN_GROUP = 32  # the FP8 MMA's K: smaller groups (16) keep backends/cuda/fp8_linear.py's dequantized path
STEP_ELEMS = 128  # inputs a step at most (one 128-input block of DeepSeek's a dot)
MIN_AMAX = 1e-10  # an all-zero group's scale floor (its codes are 0 whatever the scale)
MIN_SPLIT_STEPS = 4  # steps a split keeps at least
QUANT_ELEMS = 4096  # inputs of a row a quantizing program takes at most (whole groups)


def fp8_quantize_x_kernel(x, xq, xs, n_cols, x_stride, q_stride, s_stride, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, j): groups GROUPS j.. of x's row: codes uint8 into xq, scales f32 (amax / 448) into xs. BLOCK:
    GROUP's next power of two (masked past GROUP)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    i = tl.arange(0, BLOCK)[None, :]
    col = g[:, None] * GROUP + i  # [GROUPS, BLOCK]
    mask = (i < GROUP) & (col < n_cols)
    if PDL:  # x is an earlier kernel's output
        tl.wait_prior_grid()
        tl.launch_dependents()
    v = tl.load(x + row * x_stride + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), MIN_AMAX) / e4m3.E4M3_MAX  # [GROUPS]
    codes = e4m3.encode(v / scale[:, None])
    tl.store(xq + row * q_stride + col, codes.to(tl.uint8), mask=mask)
    tl.store(xs + row * s_stride + g, scale, mask=g * GROUP < n_cols)


def fp8_gemm_kernel(xq, xs, codes, scales, y, m_rows, n_rows, x_stride, xs_stride, c_stride, s_stride, y_stride,
                    split_stride, n_steps, steps_per_split, GROUP: tl.constexpr, BK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (BK inputs each);
    y is the output (split_stride 0) or fp32 partials [SPLIT, M, N]."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    xr = tl.minimum(m, m_rows - 1).to(tl.int64)  # past M or N: the last row, not stored
    wr = tl.minimum(n, n_rows - 1).to(tl.int64)
    kk = tl.arange(0, BK)[None, :]
    xrow, wrow = xq + xr[:, None] * x_stride + kk, codes + wr[:, None] * c_stride + kk
    xsrow, wsrow = xs + xr * xs_stride, scales + wr * s_stride
    lo = tl.program_id(2) * steps_per_split
    if PDL:  # xq and xs are the quantizing kernel's
        tl.wait_prior_grid()
        tl.launch_dependents()

    def step(it, acc):
        k0 = it * BK
        g = k0 // GROUP
        wv = tl.load(wrow + k0).to(tl.float8e4nv, bitcast=True)  # [BLOCK_N, BK]
        xv = tl.load(xrow + k0).to(tl.float8e4nv, bitcast=True)  # [BLOCK_M, BK]
        ws, xsv = tl.load(wsrow + g), tl.load(xsrow + g)
        if SWAP:
            return acc + tl.dot(wv, tl.trans(xv)) * (ws[:, None] * xsv[None, :])
        return acc + tl.dot(xv, tl.trans(wv)) * (xsv[:, None] * ws[None, :])

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)


# --- host side -------------------------------------------------------------------------------------------------

# rows bucket -> tiles (unswept on an H200: tools/sweep_fp8_gemm decides): few rows SWAP with W 64 rows a program (one
# warpgroup's wgmma M); past 64 rows x @ W.T on 64 x 256 tiles, a warpgroup a 64 x 128 half. Each step holds the
# accumulator and the step's dot (2 x 64 fp32 a thread there): 128 x 128 on 8 warps spills on sm_90 (Triton 3.7: 255
# registers, 72 bytes of stack), 64 x 256 takes 206 registers and no stack
TILES = {
    16: dict(BLOCK_M=16, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=4),
    32: dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=4),
    64: dict(BLOCK_M=64, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=4),
    128: dict(BLOCK_M=64, BLOCK_N=256, SWAP=False, num_warps=8, num_stages=3),
}
_KEYS = dict(block_m="BLOCK_M", block_n="BLOCK_N", split_k="SPLIT", swap="SWAP", num_warps="num_warps",
             num_stages="num_stages")
# (group, rows bucket, n, k) -> launcher keywords measured best on a GPU (tools/sweep_fp8_gemm prints this literal);
# a problem not listed takes TILES and the split rule.
TUNED: dict[tuple[int, int, int, int], dict] = {}


def rows_bucket(m: int) -> int:
    return row_block(m) if m <= 64 else 128


def step_of(group: int) -> int:
    """BK: the largest power of two of at most STEP_ELEMS dividing the group (0 where below MIN_GROUP)."""
    bk = _pow2_divisor(group, STEP_ELEMS)
    return bk if bk >= MIN_GROUP else 0


def default_tiles(m: int, n: int, k: int, group: int, sms: int = 132) -> dict:
    """BLOCK_M, BLOCK_N, SWAP, num_warps, num_stages by rows bucket (TILES, then TUNED's entry) and SPLIT (a power of
    two) grown until the grid fills the GPU while each split keeps MIN_SPLIT_STEPS steps."""
    cfg = dict(TILES[rows_bucket(m)])
    cfg["SPLIT"] = split_k_for(m, n, cfg["BLOCK_M"], cfg["BLOCK_N"], k // step_of(group), sms, MIN_SPLIT_STEPS)
    tuned = TUNED.get((group, rows_bucket(m), n, k), {})
    cfg.update({_KEYS[key]: v for key, v in tuned.items() if key in _KEYS})
    return cfg


def _check(x2, codes, scales) -> int:
    """The group of codes [N, K] with scales [N, K / group] for x [M, K]; ValueError naming what does not fit."""
    m, k = x2.shape
    group = weight_group(codes, scales, k)
    if not step_of(group):
        raise ValueError(f"FP8 GEMM over groups of {group} inputs: a group must be a multiple of {MIN_GROUP} (the "
                         "FP8 MMA's K)")
    if any(elem_stride(a, 1) != 1 for a in (x2, codes, scales) if a.shape[0] and a.shape[1]):
        raise ValueError(f"x [{m}, {k}], W and its scales need contiguous rows")
    return group


def quantize_x(x2, group: int, *, target: str = "numpy", pdl: bool | None = None):
    """(codes uint8 [M, K], scales f32 [M, K / group]) of x2 [M, K] (rows contiguous): e4m3 per row and group, the
    scale amax / 448."""
    m, k = x2.shape
    xq, xs = empty(x2, (m, k), "uint8"), empty(x2, (m, k // group), "float32")
    if m == 0:
        return xq, xs
    block = tl.next_power_of_2(group)
    groups = max(1, min(QUANT_ELEMS // block, tl.next_power_of_2(k // group)))
    pdl = use_pdl(target, pdl)
    kern = compile(fp8_quantize_x_kernel, target, num_warps=4, launch_pdl=pdl, GROUP=group, BLOCK=block,
                   GROUPS=groups, PDL=pdl)
    kern[m, tl.cdiv(k // group, groups)](x2, xq, xs, k, elem_stride(x2, 0), elem_stride(xq, 0), elem_stride(xs, 0))
    return xq, xs


def fp8_matmul(x2, codes, scales, *, out=None, target: str = "numpy", pdl: bool | None = None,
               block_m: int | None = None, block_n: int | None = None, split_k: int | None = None,
               swap: bool | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """y [M, N] = x2 [M, K] @ W.T for W as e4m3 bytes `codes` (uint8 [N, K]) times f32 `scales` [N, K / group]
    (group a multiple of 32), x2 quantized to e4m3 per row and group first (quantize_x); y in out's dtype (x2's
    when None). The keywords override default_tiles."""
    group = _check(x2, codes, scales)
    m, k = x2.shape
    n = codes.shape[0]
    out = gemm_out(x2, out, n)
    if m == 0 or n == 0:
        return out
    bk = step_of(group)
    cfg = default_tiles(m, n, k, group, sm_count(x2))
    over = dict(block_m=block_m, block_n=block_n, split_k=split_k, swap=swap, num_warps=num_warps,
                num_stages=num_stages)
    cfg.update({_KEYS[key]: v for key, v in over.items() if v is not None})
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT")
    xq, xs = quantize_x(x2, group, target=target, pdl=pdl)
    pdl = use_pdl(target, pdl)
    kern = compile(fp8_gemm_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl, GROUP=group, BK=bk, PDL=pdl,
                   **cfg)
    args = (m, n, elem_stride(xq, 0), elem_stride(xs, 0), elem_stride(codes, 0), elem_stride(scales, 0))
    return launch_split_k(kern, (xq, xs, codes, scales), args, out, k // bk, split, cfg["BLOCK_M"], cfg["BLOCK_N"],
                          target, pdl)


def quantize_x_ref(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of x [M, K] per row and group by fp8_blocks' encoder: scale = max(amax, MIN_AMAX) / 448 in
    f32, codes of x / scale (f32) rounded to nearest even."""
    m, k = x.shape
    xg = np.asarray(x, np.float32).reshape(m, k // group, group)
    scale = (np.maximum(np.abs(xg).max(axis=2), np.float32(MIN_AMAX)) / np.float32(e4m3.E4M3_MAX)).astype(np.float32)
    return fp8_blocks.encode(xg / scale[..., None]).reshape(m, k), scale


def fp8_matmul_ref(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x @ W.T in float64 as the kernel computes it: x quantized by quantize_x_ref, each group's product of the
    decoded bytes scaled by both scales."""
    (m, k), n = x.shape, codes.shape[0]
    group = k // scales.shape[1]
    xq, xs = quantize_x_ref(x, group)
    xv = fp8_blocks.decode(xq).astype(np.float64).reshape(m, -1, group) * xs[..., None]
    wv = fp8_blocks.decode(codes).astype(np.float64).reshape(n, -1, group) * scales[..., None]
    return xv.reshape(m, k) @ wv.reshape(n, k).T
