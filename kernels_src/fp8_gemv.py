"""GEMV y[M, N] = x[M, K] @ W.T (M <= 8) straight from FP8 weights kept as e4m3 bytes (uint8 [N, K]) and an f32
scale per GROUP inputs of a row (f32 [N, K / GROUP]; ir/formats/fp8_blocks.py's groups, split apart as the CUDA
backend keeps them): DSL kernel, host launcher, numpy reference.

Decode steps are bound by W's bytes, and e4m3 is one byte a weight, so the kernel has to decode at copy speed with
no FP8 type where the target has none (pre-Hopper GPUs, Metal, the CPU):
- A program takes ROWS weight rows and walks K BLOCK_K bytes a step; a lane loads VEC = 16 bytes of a row, which lie
  in one group (groups are multiples of 16 inputs), so the lane's 16 products are summed first and multiplied by the
  group's scale once.
- e4m3fn byte c (sign bit 7, exponent bits 6-3 of bias 7, mantissa bits 2-0) becomes the fp16 bits
  (c + (c & 0x80)) << 7: the sign carried from bit 14 to 15, exponent and mantissa at fp16's own places. fp16's
  exponent bias is 15, so that half is the e4m3 value times 2^-8 exactly, subnormals included (e4m3's exponent 0 is
  fp16's too); the 2^8 is folded into the group's scale. Three integer ops and a conversion a weight. On Triton
  (e4m3.use_cvt) FP8_CVT decodes by the DSL's FP8 type instead: one cvt.rn.f16x2.e4m3x2 for two weights on sm_90,
  the same values bit for bit (no 2^8 to fold).
- NaN codes (0x7F, 0xFF) decode as 480 (the pattern's value were it finite): checkpoints never hold them (quantizers
  clamp to +-448; fp8_blocks.encode refuses NaN), and testing for them would cost two more ops a weight.
- Under PDL (dsl.use_pdl) each step's weight and scale loads are issued before waiting for x.
More rows keep backends/cuda/fp8_linear.py's other paths.
"""

from __future__ import annotations

import numpy as np

from ir.formats import fp8_blocks
from kernels_src import e4m3
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.gemv_loop import k_loop, loop_form

MAX_ROWS = 8
VEC = 16  # bytes (weights) a lane loads a row and step; every group is a multiple of it
e4m3_as_f32 = e4m3.decode_f32  # a module global, so a test can plant a wrong decoder


def fp8_gemv_kernel(codes, scales, x, y, n_rows, n_cols, c_stride, s_stride, x_stride, y_stride,
                    GROUP: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                    STAGES: tl.constexpr = 0, FP8_CVT: tl.constexpr = False):
    """EVEN_K: K is a multiple of BLOCK_K (no masks). PREFETCH, STAGES: gemv_loop.k_loop's (a step's raw tiles:
    every row's code bytes and scales). FP8_CVT: decode by the FP8 conversion (e4m3.decode_f16's cvt)."""
    lanes = BLOCK_K // VEC
    pid = tl.program_id(0)
    rows = [pid * ROWS + i for i in range(ROWS)]
    clamped = [tl.minimum(row, n_rows - 1).to(tl.int64) for row in rows]  # the last program's spare rows re-read
    c_rows = [codes + r * c_stride for r in clamped]
    s_rows = [scales + r * s_stride for r in clamped]
    lane = tl.arange(0, lanes) * VEC
    idx = lane[:, None] + tl.arange(0, VEC)[None, :]

    def masks(k0):
        # K is a multiple of 16: a lane's bytes are all in or all out (Triton sees that from n_cols % 16 == 0)
        return (None, None) if EVEN_K else (k0 + lane < n_cols, k0 + idx < n_cols)

    def load(it):
        k0 = it * BLOCK_K
        lmask, mask = masks(k0)
        return ([tl.load(cr + k0 + idx, mask=mask, other=0) for cr in c_rows]  # weights: before the wait
                + [tl.load(sr + (k0 + lane) // GROUP, mask=lmask, other=0.0) for sr in s_rows])

    def compute(it, raw, accs):
        k0 = it * BLOCK_K
        mask = masks(k0)[1]
        if PDL and not STAGES:
            tl.wait_prior_grid()
        wv = [e4m3_as_f32(c, FP8_CVT) for c in raw[:ROWS]]
        sv = raw[ROWS:] if FP8_CVT else [s * e4m3.FP16_SHIFT for s in raw[ROWS:]]
        out = list(accs)
        for m in range(M):
            xv = tl.load(x + m * x_stride + k0 + idx, mask=mask, other=0.0).to(tl.float32)
            for i in range(ROWS):
                out[i * M + m] = out[i * M + m] + sv[i] * tl.sum(wv[i] * xv, axis=1)
        return out

    if PDL and STAGES:  # the pipeliner would hoist the first steps' x loads above a wait inside the loop
        tl.wait_prior_grid()
    init = tuple(tl.zeros((lanes,), tl.float32) for _ in range(ROWS * M))
    accs = k_loop((n_cols + BLOCK_K - 1) // BLOCK_K, load, compute, init, PREFETCH, STAGES)
    if PDL:  # a program whose loop ran no step must wait too (a later wait returns at once)
        tl.wait_prior_grid()
        tl.launch_dependents()
    for i, row in enumerate(rows):
        for m in range(M):
            tl.store(y + m * y_stride + row, tl.sum(accs[i * M + m]), mask=row < n_rows)


# --- host side -------------------------------------------------------------------------------------------------

# (group, M, N, K) -> tiles measured best on a GPU by tools/sweep_fp8_gemv (its last lines print this literal): ROWS,
# BLOCK_K, num_warps and the loop's form (prefetch, stages: gemv_loop.py). A problem not listed takes default_tiles.
TUNED: dict[tuple[int, int, int, int], dict] = {  # tools/sweep_fp8_gemv --plain, H200, 2026-12-05 (the down
    # projection's best, 16.3 us, is within 1% of default_tiles' 16.4: not listed)
    (128, 1, 6144, 4096): {'ROWS': 4, 'BLOCK_K': 1024, 'num_warps': 2, 'prefetch': False, 'stages': 0},
    (128, 1, 4096, 4096): {'ROWS': 4, 'BLOCK_K': 2048, 'num_warps': 4, 'prefetch': False, 'stages': 0},
    (128, 1, 28672, 4096): {'ROWS': 4, 'BLOCK_K': 1024, 'num_warps': 1, 'prefetch': False, 'stages': 0},
}


def default_tiles(k: int, m: int) -> dict:
    """ROWS, BLOCK_K, num_warps: 4 warps, a 16-byte vector a lane and row a step (BLOCK_K 2048 bytes, or K's next
    power of two if smaller), more rows a program as M grows (as dense_gemv's rule; unswept on a GPU)."""
    return dict(ROWS=1 if m == 1 else 2 if m <= 4 else 4, BLOCK_K=max(VEC, min(2048, tl.next_power_of_2(k))),
                num_warps=4)


def weight_group(codes, scales, k: int) -> int:
    """The group of codes [N, K] with scales [N, K / group] (a multiple of 16); ValueError naming what does not fit."""
    n = codes.shape[0]
    g = scales.shape[1] if len(scales.shape) == 2 else 0
    if len(codes.shape) != 2 or codes.shape[1] != k or g == 0 or k % g or tuple(scales.shape) != (n, g):
        raise ValueError(f"e4m3 codes {tuple(codes.shape)} with scales {tuple(scales.shape)} are not W [N, {k}] "
                         f"with a scale a group of inputs")
    fp8_blocks.check(k // g)
    return k // g


def _check(codes, scales, m: int, k: int, x) -> int:
    """weight_group, and x [M, K] a GEMV's; ValueError naming what does not fit."""
    group = weight_group(codes, scales, k)
    if not 1 <= m <= MAX_ROWS or elem_stride(x, 1) != 1 or elem_stride(codes, 1) != 1 or elem_stride(scales, 1) != 1:
        raise ValueError(f"x [{m}, {k}] (rows contiguous, as W's and the scales') does not make a GEMV of "
                         f"1-{MAX_ROWS} rows")
    return group


def fp8_gemv(x, codes, scales, *, out=None, rows: int | None = None, block_k: int | None = None,
             num_warps: int | None = None, target: str = "numpy", pdl: bool | None = None,
             prefetch: bool | None = None, stages: int | None = None):
    """y [M, N] = x [M, K] @ W.T for W as e4m3 bytes `codes` (uint8 [N, K]) times f32 `scales` [N, K / group]
    (group a multiple of 16; K for one scale a row); M <= 8. y takes out's dtype (x's when out is None). Tiles and
    the loop's form (prefetch, stages: kernels_src/gemv_loop.py) default to TUNED's, else default_tiles'."""
    m, k = x.shape
    group = _check(codes, scales, m, k, x)
    n = codes.shape[0]
    out = empty(x, (m, n)) if out is None else out
    cfg = dict(TUNED.get((group, m, n, k)) or default_tiles(k, m))
    prefetch, stages = loop_form({key: cfg.pop(key) for key in ("prefetch", "stages") if key in cfg}, prefetch, stages)
    cfg.update({key: v for key, v in (("ROWS", rows), ("BLOCK_K", block_k), ("num_warps", num_warps))
                if v is not None})
    nw = cfg.pop("num_warps")
    if cfg["BLOCK_K"] < VEC or cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) or not 1 <= cfg["ROWS"] <= 16:
        raise ValueError(f"tiles {cfg}: BLOCK_K is a power of two of at least {VEC}, ROWS 1-16")
    pdl = use_pdl(target, pdl)
    kern = compile(fp8_gemv_kernel, target, num_warps=nw, launch_pdl=pdl, GROUP=group, M=m, PDL=pdl,
                   EVEN_K=k % cfg["BLOCK_K"] == 0, PREFETCH=prefetch, STAGES=stages, FP8_CVT=e4m3.use_cvt(target),
                   **cfg)
    kern[(tl.cdiv(n, cfg["ROWS"]),)](codes, scales, x, out, n, k, elem_stride(codes, 0), elem_stride(scales, 0),
                                     elem_stride(x, 0), elem_stride(out, 0))
    return out


def fp8_gemv_ref(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x @ W.T in fp64, W decoded by ir/formats/fp8_blocks.py's e4m3 table and scaled per group."""
    n, k = codes.shape
    w = fp8_blocks.decode(codes).astype(np.float64).reshape(n, scales.shape[1], -1) * scales[..., None]
    return np.asarray(x, np.float64) @ w.reshape(n, k).T
