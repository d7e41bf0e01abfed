"""Skinny dense GEMM y[M, N] = x[M, K] @ W[N, K].T over fp16/bf16 weights for decode batches of 9-64 rows (wider
where a sweep says it wins) on tensor cores: DSL kernel, host launcher, numpy reference.

A decode step's linears at 16-64 rows are still memory bound: W is streamed once, x is small. cuBLAS reads W at
76-93% of copy on Llama-3-8B's shapes (docs/BENCHMARKS.md); this kernel's only job is to keep W's loads in flight:
- A program owns a [BLOCK_M, BLOCK_N] tile of y and walks its K range BLOCK_K a step: W's [BLOCK_N, BLOCK_K] tile
  and x's [BLOCK_M, BLOCK_K] meet in one `tl.dot`, fp32 accumulation. The loop's loads are plain tile loads, so
  Triton's software pipeline (num_stages) streams both through shared memory (cp.async on sm_90).
- SWAP (default): the dot is W @ x.T, N on the MMA's M axis (Hopper's wgmma takes 64 a warpgroup there) and the
  batch's 16-64 rows its N; without SWAP it is x @ W.T.
- Rows of x past M and of W past N are clamped (read again, not stored), so only a ragged K tail is masked (EVEN_K
  off when BLOCK_K does not divide K).
- Split-K (the grid of N / BLOCK_N tiles is 64 programs at N = 4096): SPLIT programs share a tile's K range and
  write fp32 partials that dequant_gemm_reduce_kernel adds (split_k.launch_split_k, shared with the quantized
  GEMMs). The DSL has no atomics, and they would not save the second pass: an fp32 atomic sum still needs y zeroed
  first and a cast to bf16 after, and bf16 atomics round every partial. The partials (<= 16 MiB) stay in L2 and the
  reduce is a PDL launch, so it starts while the GEMM's last programs run.
The runner takes it only for the (row bucket, N, K) that TUNED (or the file LLM_ENGINE_DENSE_GEMM_TUNED names, a
tools/sweep_dense_gemm --json) lists: problems where a GPU sweep saw it beat cuBLAS.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from kernels_src.dsl import Plans, compile, elem_stride, empty, signature, tl, use_pdl
from kernels_src.split_k import (
    MIN_SPLIT_STEPS,
    gemm_out,
    launch_split_k,
    sm_count,
    split_k_for,
    split_k_plan,
    split_k_tile,
)

MIN_ROWS = 9  # fewer rows: dense_gemv or cuBLAS (the MMA's 16-row tile would be mostly padding)
MAX_BLOCK_M = 64
TUNED_ENV = "LLM_ENGINE_DENSE_GEMM_TUNED"
_KEYS = dict(block_m="BLOCK_M", block_n="BLOCK_N", block_k="BLOCK_K", split_k="SPLIT", swap="SWAP",
             num_warps="num_warps", num_stages="num_stages")
# (row bucket, n, k) -> launcher keywords that beat cuBLAS by >= 3% on an H200 (tools/sweep_dense_gemm prints this
# literal): a problem not listed stays on cuBLAS in the runner. `sweep_dense_gemm --ms 64,16,32 --quick`, 2026-12-03
# 22:31 UTC (cuBLAS us -> ours): o at 16 and 32 rows 13.8 -> 10.7 and 14.0 -> 11.8, down at 16 32.3 -> 31.2, qkv at 16
# 15.9 -> 15.2, the LM head at 32 and 64 257.3 -> 242.7 and 271.5 -> 252.3; cuBLAS kept qkv and o at 64 rows
# (ours 0.88x, 0.91x) and gate_up everywhere.
TUNED: dict[tuple[int, int, int], dict] = {
    (16, 4096, 4096): dict(block_m=16, block_n=64, block_k=64, split_k=4, swap=True, num_warps=4, num_stages=4),
    (16, 4096, 14336): dict(block_m=16, block_n=64, block_k=64, split_k=4, swap=True, num_warps=4, num_stages=4),
    (16, 6144, 4096): dict(block_m=16, block_n=32, block_k=128, split_k=2, swap=True, num_warps=4, num_stages=4),
    (32, 4096, 4096): dict(block_m=32, block_n=64, block_k=64, split_k=4, swap=True, num_warps=4, num_stages=4),
    (32, 128256, 4096): dict(block_m=32, block_n=128, block_k=128, split_k=1, swap=True, num_warps=8, num_stages=4),
    (64, 128256, 4096): dict(block_m=64, block_n=128, block_k=128, split_k=1, swap=True, num_warps=8, num_stages=4),
}


def dense_gemm_kernel(w, x, y, m_rows, n_rows, n_cols, w_stride, x_stride, y_stride, split_stride, n_steps,
                      steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SWAP: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., K steps s * steps_per_split..; y is the output
    (split_stride 0) or fp32 partials [SPLIT, M, N]."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    wrow = w + tl.minimum(n, n_rows - 1).to(tl.int64)[:, None] * w_stride + kk[None, :]
    xrow = x + tl.minimum(m, m_rows - 1).to(tl.int64)[:, None] * x_stride + kk[None, :]
    if PDL:  # x is an earlier kernel's output
        tl.wait_prior_grid()
        tl.launch_dependents()

    def step(it, acc):
        k0 = it * BLOCK_K
        if EVEN_K:
            wv, xv = tl.load(wrow + k0), tl.load(xrow + k0)
        else:
            mask = kk[None, :] < n_cols - k0
            wv, xv = tl.load(wrow + k0, mask=mask, other=0.0), tl.load(xrow + k0, mask=mask, other=0.0)
        return tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)

    split_k_tile(step, tl.program_id(2) * steps_per_split, steps_per_split, n_steps, y, m, n, m_rows, n_rows,
                 y_stride, split_stride, SWAP)


# --- host side -------------------------------------------------------------------------------------------------


def row_bucket(m: int) -> int:
    """TUNED's row key: M's next power of two, at least 16 (the sweep's 16 / 32 / 64 rows, and wider)."""
    return max(16, tl.next_power_of_2(m))


def tuned(m: int, n: int, k: int) -> dict:
    """The problem's table entry (launcher keywords): LLM_ENGINE_DENSE_GEMM_TUNED's file first, then TUNED; {} when
    neither lists it or M is below MIN_ROWS."""
    if m < MIN_ROWS:
        return {}
    key = (row_bucket(m), n, k)
    return _env_tuned().get(key) or TUNED.get(key, {})


@functools.cache
def _env_tuned() -> dict:
    """{(row bucket, n, k): keywords} of the settings a `tools/sweep_dense_gemm --json` file marks as beating cuBLAS
    (`use`); {} without the variable. A file that is not such a table is a ValueError naming it."""
    path = os.environ.get(TUNED_ENV)
    if not path:
        return {}
    try:
        rows = json.loads(open(path).read())["results"]
        return {(row_bucket(int(r["m"])), int(r["n"]), int(r["k"])): dict(r["tiles"]) for r in rows if r.get("use")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{TUNED_ENV}={path}: not a tools/sweep_dense_gemm --json table ({e})") from e


def default_tiles(m: int, n: int, k: int, sms: int = 132) -> dict:
    """BLOCK_M (M's bucket, at most 64), BLOCK_N 64, BLOCK_K 128 (K's next power of two when smaller), SPLIT (grown
    until the grid gives every SM two programs, as dequant_gemm's), SWAP, num_warps 4, num_stages 4; a table
    entry's keywords over them."""
    block_m, block_k = min(MAX_BLOCK_M, row_bucket(m)), max(16, min(128, tl.next_power_of_2(k)))
    split = split_k_for(m, n, block_m, 64, tl.cdiv(k, block_k), sms, MIN_SPLIT_STEPS)
    cfg = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, SPLIT=split, SWAP=True, num_warps=4, num_stages=4)
    cfg.update({_KEYS[key]: v for key, v in tuned(m, n, k).items() if key in _KEYS})
    return cfg


def _pow2_at_least_16(v) -> bool:
    return isinstance(v, int) and v >= 16 and not v & (v - 1)


def _check(x2, w) -> None:
    if len(x2.shape) != 2 or len(w.shape) != 2 or x2.shape[1] != w.shape[1] or x2.shape[1] == 0:
        raise ValueError(f"x {tuple(x2.shape)} and w {tuple(w.shape)} do not make a GEMM x @ w.T")
    if str(x2.dtype) != str(w.dtype):
        raise ValueError(f"x is {x2.dtype} and w {w.dtype}: the dense GEMM takes one dtype for both")
    if w.shape[0] and elem_stride(w, 1) != 1:
        raise ValueError(f"w {tuple(w.shape)} must have contiguous rows (stride {elem_stride(w, 1)} along K)")


def _build(x2, n: int, target: str, pdl: bool, over: dict) -> tuple:
    """(the GEMM kernel, its tiles, SPLIT) for x2 [M, K] @ W[n, K].T: default_tiles, `over`'s keywords over them."""
    m, k = x2.shape
    cfg = default_tiles(m, n, k, sm_count(x2))
    cfg.update({_KEYS[key]: v for key, v in over.items() if v is not None})
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT")
    if not all(_pow2_at_least_16(cfg[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) or split < 1:
        raise ValueError(f"dense_matmul tiles {cfg} (split {split}): BLOCK_M, BLOCK_N and BLOCK_K must be powers of "
                         "two of at least 16 (the MMA's smallest), split_k at least 1")
    kern = compile(dense_gemm_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl,
                   EVEN_K=k % cfg["BLOCK_K"] == 0, PDL=pdl, **cfg)
    return kern, cfg, split


def dense_matmul(x2, w, *, out=None, target: str = "numpy", pdl: bool | None = None, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                 swap: bool | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """y [M, N] = x2 [M, K] @ w.T for w [N, K] (rows contiguous) of x2's dtype (fp16 / bf16; fp32 runs too, as full
    IEEE dots); out (made when not given) [M, N] with contiguous rows. The keywords override default_tiles."""
    _check(x2, w)
    m, k = x2.shape
    n = w.shape[0]
    if m and elem_stride(x2, 1) != 1:
        x2 = x2.contiguous() if hasattr(x2, "contiguous") else np.ascontiguousarray(x2)
    out = gemm_out(x2, out, n)
    if m == 0 or n == 0:
        return out
    over = dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, swap=swap, num_warps=num_warps,
                num_stages=num_stages)
    pdl = use_pdl(target, pdl)
    kern, cfg, split = _build(x2, n, target, pdl, over)
    return launch_split_k(kern, (w, x2), (m, n, k, elem_stride(w, 0), elem_stride(x2, 0)), out,
                          tl.cdiv(k, cfg["BLOCK_K"]), split, cfg["BLOCK_M"], cfg["BLOCK_N"], target, pdl)


# (x2, w, out: shapes, strides, dtypes; target, pdl) -> launched's plan: an eager step's decisions, made once
_PLANS = Plans()


def _plan(x2, w, out, target: str, pdl: bool) -> tuple:
    """(the GEMM's BoundLaunch, its integers after y, the reduce's BoundLaunch and its integers after part and out,
    or None, None; SPLIT): launch_split_k's launches (split_k_plan), worked out once for arrays of these shapes."""
    (m, k), n = x2.shape, w.shape[0]
    kern, cfg, split = _build(x2, n, target, pdl, {})
    grid, ints, red, red_grid, red_ints, split = split_k_plan(
        (m, n, k, elem_stride(w, 0), elem_stride(x2, 0)), out, tl.cdiv(k, cfg["BLOCK_K"]), split, cfg["BLOCK_M"],
        cfg["BLOCK_N"], target, pdl)
    return kern.bind(grid), ints, None if red is None else red.bind(red_grid), red_ints, split


# One fp32 scratch a device for every launched GEMM's split-K partials (an 8B model's 16-row step would otherwise keep
# ~90 MB of them, a layer's three projections' at a time): each reduce reads its partials before the next GEMM writes
# (one stream; under PDL every program of the next GEMM waits for the kernel before it ahead of its first store).
_PARTIALS: dict = {}


def _partials(out, split: int):
    need = split * out.shape[0] * out.shape[1]
    buf = _PARTIALS.get(out.device)
    if buf is None or buf.shape[0] < need:  # a larger one: launches kept with the old one keep it alive
        buf = _PARTIALS[out.device] = empty(out, (need,), "float32")
    return buf[:need].view(split, *out.shape)


def _split_launch(gemm, gemm_args: tuple, red, red_args: tuple) -> None:
    gemm(*gemm_args)
    red(*red_args)


def launched(x2, w, *, out, target: str = "numpy", pdl: bool | None = None) -> tuple:
    """(dense_matmul(x2, w, out=out)'s result, (launch, its arguments) or None) for x2 [M, K] and out [M, N] with
    contiguous rows, at the default tiles: a caller passing the same arrays again (an eager step's kept buffers,
    backends/cuda/step_arena.py) may call launch(*arguments) for the same result, skipping the tiles, the kernels'
    lookups and the split-K partials' allocation (the device's one scratch, _PARTIALS). As dense_gemv's `launched`:
    an eager step's GEMM for two C launches (a dense_matmul call cost ~4x torch.mm's host time, 2026-12-05)."""
    if type(x2) is np.ndarray or out is None or elem_stride(x2, 1) != 1 or not x2.shape[0] or not w.shape[0]:
        return dense_matmul(x2, w, out=out, target=target, pdl=pdl), None
    pdl = use_pdl(target, pdl)
    key = (signature(x2, w, out), target, pdl)
    plan = _PLANS.get(key)
    if plan is None:
        _check(x2, w)
        gemm_out(x2, out, w.shape[0])
        plan = _PLANS.put(key, _plan(x2, w, out, target, pdl))
    gemm, ints, red, red_ints, split = plan
    if red is None:
        launch, args = gemm, (w, x2, out, *ints)
    else:
        part = _partials(out, split)
        launch, args = _split_launch, (gemm, (w, x2, part, *ints), red, (part, out, *red_ints))
    launch(*args)
    return out, (launch, args)


def dense_matmul_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T in float64."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
