"""Dequantizing GEMM y[M, N] = x[M, K] @ dequantize(W).T for 2..256 rows, straight from GGUF blocks on tensor
cores: DSL kernels, launcher, reference.

W is the raw bytes [N, row_bytes] of any format kernels_src/dequantize.py decodes (its `_family`: new formats there
come for free). A GEMV (dequant_gemv) re-reads W for every few rows; dequantizing W to fp16 first writes and
re-reads the whole matrix. Here W is read once per BLOCK_M rows of x and never written:
- A program owns a [BLOCK_M, BLOCK_N] tile of y and walks K a step of KB blocks (or super-blocks) at a time. Its
  BLOCK_N rows' blocks are one tile of BLOCK_N * KB block pointers, which dequantize.py's decoder turns into
  (element offsets in a block, values) pieces; each piece, reshaped to [BLOCK_N, KB * piece] (row-major: the
  block tile's order, so no data moves), meets x's matching elements (loaded through the same offsets, so the
  decoder's element order needs no undoing) in one `tl.dot` of x's dtype, accumulated in fp32.
- SWAP (default): the dot is W [BLOCK_N, k] @ x.T [k, BLOCK_M], so BLOCK_N is the MMA's M dimension (Hopper's
  wgmma wants 64 a warpgroup there, and takes the dequantized W straight from registers) and a batch of 16 rows
  is its N. Without SWAP it is x @ W.T (mma.sync's 16-row tiles on Hopper).
- KB divides the row's block count (no tail step); rows of x past M and of W past N are clamped (read again, not
  stored), so no load is masked.
- Split-K (kernels_src/split_k.py): when the grid (M tiles x N tiles) would not fill the GPU (N = 4096 with
  K = 14336: 64 programs), SPLIT programs share a tile's K range, write fp32 partials [SPLIT, M, N] and
  dequant_gemm_reduce_kernel adds them. The grid and the scratch depend on (M, N, K) only, so the launch is safe
  inside CUDA graphs.
"""

from __future__ import annotations

import functools

import numpy as np

from ir.formats.gguf_quants import QTYPES as GGUF
from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src import dequantize as dq
from kernels_src import gemm_tuned
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.dsl.ir import TileType
from kernels_src.split_k import (
    MIN_SPLIT_STEPS,
    SMS,
    gemm_out,
    launch_split_k,
    sm_count,
    split_k_for,
    split_k_tile,
)

__all__ = ["MAX_ROWS", "VARIANTS", "default_tiles", "dequant_matmul", "dequant_matmul_ref"]

MAX_ROWS = 256  # the rows the defaults are tuned for (any M runs: BLOCK_M rows a program)


def _numel(shape) -> int:
    return TileType(tl.float32, tuple(shape)).numel


def word_tile(w, x, m_rows, n_rows, w_stride, x_stride, BLOCK_M: int, BLOCK_N: int, K: int, PDL: bool):
    """The word-gathering variants' program start: (m, n, W's rows [BLOCK_N, 1] as word pointers, x's [BLOCK_M, K]
    pointers at K = 0); rows past M and N clamped to the last (read again, not stored); the PDL wait."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = w + tl.minimum(n, n_rows - 1).to(tl.int64)[:, None] * w_stride
    xrow = x + tl.minimum(m, m_rows - 1).to(tl.int64)[:, None] * x_stride + tl.arange(0, K)[None, :]
    if PDL:  # x is an earlier kernel's output
        tl.wait_prior_grid()
        tl.launch_dependents()
    return m, n, wrow, xrow


def dequant_gemm_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                        steps_per_split, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        KB: tl.constexpr, SWAP: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr = False,
                        WORDS: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (KB blocks each);
    y is the output (split_stride 0) or fp32 partials [SPLIT, M, N]. WORDS: headers as 32-bit words (variant words)."""
    elems, size = GGUF[QTYPE].block_size, GGUF[QTYPE].type_size
    rank, decode = dq._family(QTYPE, WIDE, WORDS)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_N * KB)  # block tile: row r // KB of the program's, block r % KB of the step's
    row = tl.minimum(tl.program_id(1) * BLOCK_N + r // KB, n_rows - 1)  # past N: the last row, not stored
    wrow = w + row.to(tl.int64) * w_stride + (r % KB) * size
    for _ in range(rank - 1):
        wrow = wrow[:, None]
    xrow = x + tl.minimum(m, m_rows - 1).to(tl.int64) * x_stride  # past M: the last row, not stored
    xrow, kb = xrow[:, None], tl.arange(0, KB)[None, :]
    for _ in range(rank - 1):  # [BLOCK_M, KB, 1, ..]: x's elements of a piece keep the decoder's contiguous axis
        xrow, kb = xrow[:, :, None], kb[:, :, None]
    lo = tl.program_id(2) * steps_per_split
    if PDL:  # x is an earlier kernel's output
        tl.wait_prior_grid()
        tl.launch_dependents()

    def step(it, acc):
        b0 = it * KB
        for off, val in decode(wrow + b0 * size):
            piece = val.shape[1:]
            p = _numel(piece)
            wv = tl.reshape(val, (BLOCK_N, KB * p)).to(xrow.dtype.element_ty)
            xv = tl.reshape(tl.load(xrow + (b0 + kb) * elems + off[None]), (BLOCK_M, KB * p))
            acc = tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)
        return acc

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)


# --- host side -------------------------------------------------------------------------------------------------

STEP_ELEMS = 128  # elements of a row a step covers (KB blocks of 32-element formats; 256 takes 235+ registers)
# (qtype, row bucket 16 / 32 / 64, n, k) -> launcher keywords measured best on an H200 (tools/sweep_gemm.py prints
# this literal); a problem not listed takes default_tiles' rule.
# Q4_K at 16 and 64 rows on Llama-3-8B's fused shapes: `sweep_gemm --variants words,stream --qtypes Q4_K --quick`,
# 2026-12-03 22:48 UTC (stream 1.3-1.5x words at 64 rows; Q4_K_M batch 64 5,886 -> 7,176 tok/s end to end).
TUNED: dict[tuple[str, int, int, int], dict] = {  # tools/sweep_gemm, H200: 2026-12-01; 2026-12-03 variants
    ('Q4_K', 16, 1024, 4096):
        dict(variant="words", block_m=16, block_n=32, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q4_K', 16, 4096, 4096):
        dict(variant="stream", block_m=16, block_n=128, split_k=8, swap=True, num_warps=8, num_stages=3, chunks=2),
    ('Q4_K', 16, 4096, 14336):
        dict(variant="words", block_m=16, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q4_K', 16, 6144, 4096):
        dict(variant="stream", block_m=16, block_n=32, split_k=2, swap=True, num_warps=4, num_stages=3, chunks=2),
    ('Q4_K', 16, 14336, 4096):
        dict(block_m=16, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q4_K', 16, 28672, 4096):
        dict(variant="stream", block_m=16, block_n=64, split_k=2, swap=True, num_warps=4, num_stages=3, chunks=4),
    ('Q4_K', 32, 4096, 14336):
        dict(block_m=32, block_n=128, split_k=8, swap=True, num_warps=8, num_stages=3),
    ('Q4_K', 32, 6144, 4096):
        dict(block_m=32, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q4_K', 32, 14336, 4096):
        dict(block_m=32, block_n=128, split_k=2, swap=True, num_warps=8, num_stages=3),
    ('Q4_K', 64, 1024, 4096):
        dict(variant="words", block_m=64, block_n=32, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q4_K', 64, 4096, 4096):
        dict(variant="stream", block_m=64, block_n=64, split_k=4, swap=False, num_warps=4, num_stages=3, chunks=2),
    ('Q4_K', 64, 4096, 14336):
        dict(variant="stream", block_m=64, block_n=64, split_k=4, swap=False, num_warps=4, num_stages=3, chunks=2),
    ('Q4_K', 64, 6144, 4096):
        dict(variant="stream", block_m=64, block_n=64, split_k=4, swap=False, num_warps=4, num_stages=3, chunks=2),
    ('Q4_K', 64, 14336, 4096):
        dict(block_m=64, block_n=128, split_k=1, swap=True, num_warps=8, num_stages=3),
    ('Q4_K', 64, 28672, 4096):
        dict(variant="stream", block_m=64, block_n=64, split_k=2, swap=True, num_warps=4, num_stages=3, chunks=2),
    ('Q6_K', 16, 1024, 4096):
        dict(variant="blocked", block_m=16, block_n=32, split_k=8, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 16, 4096, 4096):
        dict(variant="blocked", block_m=16, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 16, 4096, 14336):
        dict(variant="blocked", block_m=16, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 16, 6144, 4096):
        dict(variant="blocked", block_m=16, block_n=64, split_k=8, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 16, 14336, 4096):
        dict(block_m=16, block_n=64, split_k=1, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 16, 28672, 4096):
        dict(variant="blocked", block_m=16, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 32, 4096, 14336):
        dict(block_m=32, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 32, 6144, 4096):
        dict(block_m=32, block_n=64, split_k=8, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 32, 14336, 4096):
        dict(block_m=32, block_n=64, split_k=1, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 64, 1024, 4096):
        dict(variant="blocked", block_m=64, block_n=32, split_k=8, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 64, 4096, 4096):
        dict(variant="blocked", block_m=64, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 64, 4096, 14336):
        dict(variant="blocked", block_m=64, block_n=64, split_k=4, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 64, 6144, 4096):
        dict(variant="blocked", block_m=64, block_n=64, split_k=4, swap=False, num_warps=4, num_stages=3),
    ('Q6_K', 64, 14336, 4096):
        dict(block_m=64, block_n=32, split_k=2, swap=True, num_warps=4, num_stages=3),
    ('Q6_K', 64, 28672, 4096):
        dict(variant="blocked", block_m=64, block_n=32, split_k=2, swap=True, num_warps=4, num_stages=3),
}
# "blocked": dequant_gemm_kernel (any format, a step of KB blocks through dequantize.py's decoders); "words": the same
# with Q4_K's / Q5_K's headers read as 32-bit words (so Triton pipelines them; blocked's fp16 and byte loads of them
# are synchronous, a wait every step); "sub64": Q4_K only,
# kernels_src/dequant_gemm_q4k.py (64-input steps, every load of W a 32-bit word); "stream": Q4_K and Q6_K,
# kernels_src/dequant_gemm_stream*.py (a step's weights 2-D tiles of 32-bit words decoded in x's order, one dot over
# x as stored). The GPU sweep (tools/sweep_gemm
# --variants) decides the default.
VARIANTS = {"blocked": None, "words": dq.WORD_HEADS, "sub64": ("Q4_K",), "stream": ("Q4_K", "Q6_K")}
VARIANT = "blocked"
WORD_VARIANTS = ("words", "sub64", "stream")  # rows read as 32-bit words: they must start 4-byte aligned
_KEYS = dict(block_m="BLOCK_M", block_n="BLOCK_N", blocks="KB", split_k="SPLIT", swap="SWAP", num_warps="num_warps",
             num_stages="num_stages", chunks="CHUNKS")
STREAM_CHUNKS = 2  # stream's step when no table names one: half a super-block (fewer registers than a whole one)
def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def row_block(m: int) -> int:
    """BLOCK_M for M rows: 16 / 32 / 64 (the MMA's smallest M is 16)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_tiles(qtype: str, m: int, n: int, k: int, sms: int = SMS) -> dict:
    """BLOCK_M (16 / 32 / 64 by M), BLOCK_N, KB, SPLIT, SWAP and num_warps / num_stages for an [m, k] x [n, k]
    problem: SPLIT (a power of two) grows until the grid gives every SM WAVE_PROGRAMS programs, while each split
    keeps MIN_SPLIT_STEPS steps and the partials fit PART_BYTES."""
    elems = GGUF[qtype.upper()].block_size
    n_blocks = k // elems
    block_m, block_n = row_block(m), 64
    kb = _pow2_divisor(n_blocks, max(1, STEP_ELEMS // elems))
    split = split_k_for(m, n, block_m, block_n, n_blocks // kb, sms, MIN_SPLIT_STEPS)
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, KB=kb, SPLIT=split, SWAP=True, num_warps=4, num_stages=None)
    cfg.update({_KEYS[key]: v for key, v in tuned(qtype, m, n, k).items() if key in _KEYS})
    return cfg


def tuned_variant(qtype: str, m: int, n: int, k: int) -> str:
    """The variant TUNED names for the problem (its tiles were measured with it), else VARIANT."""
    return tuned(qtype, m, n, k).get("variant", VARIANT)


def tuned(qtype: str, m: int, n: int, k: int) -> dict:
    """The problem's TUNED entry: LLM_ENGINE_GEMM_TUNED's file first (kernels_src/gemm_tuned.py), then TUNED."""
    key = (qtype.upper(), row_block(m), n, k)
    return _env_tuned().get(key) or TUNED.get(key, {})


@functools.cache
def _env_tuned() -> dict:
    return gemm_tuned.table(lambda r: None if gemm_tuned.INT_TYPE.fullmatch(r["type"].lower()) else
                            (r["type"].upper(), row_block(r["m"]), r["n"], r["k"]))


def _addr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


def dequant_matmul(x2, w, qtype: str, *, out=None, target: str = "numpy", pdl: bool | None = None,
                   block_m: int | None = None, block_n: int | None = None, blocks: int | None = None,
                   split_k: int | None = None, swap: bool | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, variant: str | None = None, chunks: int | None = None):
    """y [M, N] = x2 [M, K] @ dequantize(w).T for raw GGUF blocks w (uint8 [N, >= row_bytes], rows 2-byte aligned);
    x2 fp32 / fp16 / bf16 with contiguous rows; out (made when not given) in x2's dtype, rows contiguous.
    The keywords override default_tiles (block_m, block_n, blocks = KB, split_k, swap, num_warps, num_stages);
    variant (VARIANTS, default VARIANT) picks the kernel; chunks (stream: 1, 2 or 4 of a super-block's 64-input
    chunks a step)."""
    qtype = qtype.upper()
    if qtype not in dq.QTYPES:
        raise ValueError(f"unsupported qtype {qtype!r} (supported: {', '.join(dq.QTYPES)})")
    m, k = x2.shape
    n = w.shape[0]
    elems = GGUF[qtype].block_size
    if k <= 0 or k % elems or len(w.shape) != 2 or w.shape[1] < row_bytes(qtype, k) or elem_stride(w, 1) != 1:
        raise ValueError(f"x [{m}, {k}] and {qtype} weights {tuple(w.shape)} do not make a GEMM")
    if _addr(w) % 2 or (n > 1 and elem_stride(w, 0) % 2):
        raise ValueError("weight rows must start 2-byte aligned (the blocks' fp16 scales are read as such)")
    explicit, variant = variant is not None, variant or tuned_variant(qtype, m, w.shape[0], k)
    if variant in WORD_VARIANTS and not explicit and not _whole_words(w):
        variant = "blocked"  # a table's choice on rows it cannot read as words: the general kernel
    if variant not in VARIANTS or qtype not in (VARIANTS[variant] or (qtype,)):
        raise ValueError(f"dequant_matmul: variant {variant!r} does not take {qtype} (variants: "
                         + ", ".join(f"{v} ({', '.join(q or ('any',))})" for v, q in VARIANTS.items()) + ")")
    if m and elem_stride(x2, 1) != 1:
        x2 = x2.contiguous() if hasattr(x2, "contiguous") else np.ascontiguousarray(x2)
    out = gemm_out(x2, out, n)
    if m == 0 or n == 0:
        return out
    cfg = default_tiles(qtype, m, n, k, sm_count(x2))
    over = dict(block_m=block_m, block_n=block_n, blocks=blocks, split_k=split_k, swap=swap, num_warps=num_warps,
                num_stages=num_stages, chunks=chunks)
    cfg.update({_KEYS[key]: v for key, v in over.items() if v is not None})
    nw, ns, split, chunks = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT"), cfg.pop("CHUNKS", None)
    n_steps = k // elems // cfg["KB"]
    if n_steps * cfg["KB"] * elems != k:
        raise ValueError(f"blocks={cfg['KB']} does not divide the {k // elems} blocks of a row")
    pdl = use_pdl(target, pdl)
    if variant in ("sub64", "stream"):
        return _launch_words(variant, qtype, x2, w, out, cfg, nw, ns, split, target, pdl, chunks or STREAM_CHUNKS)
    if variant == "words" and not _whole_words(w):
        raise ValueError(f"variant words reads {qtype} headers as 32-bit words: rows {tuple(w.shape)} of stride "
                         f"{elem_stride(w, 0)} must start 4-byte aligned")
    kern = compile(dequant_gemm_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl, QTYPE=qtype,
                   WIDE=target in dq.WIDE_TARGETS, PDL=pdl, WORDS=variant == "words", **cfg)
    return launch_split_k(kern, (w, x2), (m, n, elem_stride(w, 0), elem_stride(x2, 0)), out, n_steps, split,
                          cfg["BLOCK_M"], cfg["BLOCK_N"], target, pdl)


def _whole_words(w) -> bool:
    return not (_addr(w) % 4 or (w.shape[0] > 1 and elem_stride(w, 0) % 4) or w.shape[1] % 4)


def _launch_words(variant: str, qtype: str, x2, w, out, cfg: dict, nw: int, ns: int | None, split: int, target: str,
                  pdl: bool, chunks: int):
    """Variants sub64 and stream: W as int32 words (rows must start 4-byte aligned and be whole words)."""
    from kernels_src.dequant_gemm_q4k import STEP, dequant_gemm_q4k_kernel
    from kernels_src.dequant_gemm_stream import dequant_gemm_stream_kernel
    from kernels_src.dequant_gemm_stream_q6k import dequant_gemm_stream_q6k_kernel

    if not _whole_words(w):
        raise ValueError(f"variant {variant} reads {qtype} rows as 32-bit words: rows {tuple(w.shape)} of stride "
                         f"{elem_stride(w, 0)} must start 4-byte aligned and be whole words")
    if variant == "stream" and chunks not in (1, 2, 4):
        raise ValueError(f"variant stream takes 1, 2 or 4 of a super-block's four 64-input chunks a step, not "
                         f"chunks={chunks}")
    words = w.view(np.int32) if isinstance(w, np.ndarray) else w.view(__import__("torch").int32)  # no copy
    m, k = x2.shape
    stream = dequant_gemm_stream_q6k_kernel if qtype == "Q6_K" else dequant_gemm_stream_kernel
    kernel, step, extra = ((stream, 64 * chunks, dict(CHUNKS=chunks)) if variant == "stream"
                           else (dequant_gemm_q4k_kernel, STEP, {}))
    kern = compile(kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl,
                   BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SWAP=cfg["SWAP"], PDL=pdl, **extra)
    return launch_split_k(kern, (words, x2), (m, w.shape[0], elem_stride(words, 0), elem_stride(x2, 0)), out,
                          k // step, split, cfg["BLOCK_M"], cfg["BLOCK_N"], target, pdl)


def dequant_matmul_ref(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    """x @ W.T in float64, W decoded by our numpy dequantizer (ir/formats/gguf_quants.py)."""
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    wd = dequantize(np.ascontiguousarray(np.asarray(w)[:, :row_bytes(qtype, k)]), qtype, (w.shape[0], k))
    return x @ wd.astype(np.float64).T
