"""Dequantizing GEMV y[M, N] = x[M, K] @ W.T (M <= 8) straight from GGUF blocks: DSL kernel, launcher, reference.

W is the raw bytes [N, row_bytes] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; layouts in
ir/formats/gguf_quants.py; the per-format code in gguf_gemv_legacy.py and gguf_gemv_kquants.py). The GEMV
streams W once and is bound by memory, so the kernel spends few instructions per quant and keeps loads in flight:
- A program (one warp) takes ROWS rows, unrolled, and walks K STEP blocks at a time; each step's loads (W for
  every row, x once) come before its arithmetic, so they are in flight together. A lane owns PARTS vectors of 4
  consecutive words of one block (32-bit for Q4_K and Q5_K, whose 144- and 176-byte super-blocks keep 16-byte
  alignment; 16-bit for the others, whose blocks are 2- or 4-byte aligned) and the x elements that meet them.
  x is converted once per step and reused by every row.
- A quant field is masked in place, never shifted down, and read as a float (`_Decode`): its bits as an fp32
  subnormal where the target has IEEE subnormals (Triton), so a quant costs one LOP3 and one FMA; or OR-ed into
  2**23 and the 2**23 subtracted (SIMT targets: CuPy compiles with -ftz=true, Metal flushes subnormals). x is
  pre-scaled once per step to meet each field position. A quant split over two arrays (Q5's fifth bits, Q3_K's
  third, Q6_K's top two) has its high bits moved just above its low ones with a shift and a LOP3 a word first.
- Offsets and minimums (Q4_0's -8, Q4_1's m, Q5_0's -16, Q8_0's sign, the k-quants' mins, Q3_K's -4, Q6_K's
  -32) are applied once per block through sums of x; scales multiply once per lane and block, after the lane's
  quants are summed.
- A loaded tile that the arithmetic broadcasts against a larger one (Q5_K's qh, shared by a block's 4 chunks; Q3_K's
  hmask and scales) is loaded at the full shape from broadcast addresses (`+ 0 * chunks`): broadcasting the loaded
  values made Triton convert layouts through shared memory, with barriers, in every step (Q5_K: 915 SASS a step
  and 120 registers against 722 and 95; Q3_K 1126 and 186 against 909 and 108; the repeated addresses hit L1).
- Only scale fields are masked to 0 (only d where the other scales are integers); quant words and x are read
  through clamped addresses (past the end: the last block again), since a block whose scales read as 0 adds
  nothing. That saves zeroing registers before each load.

Q4_K on Triton takes int8 activations by default (dp4a, llama.cpp's way): kernels_src/dequant_gemv_i8.py.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ir.formats.gguf_quants import QTYPES as GGUF
from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src import gguf_gemv_kquants as kquants
from kernels_src import gguf_gemv_legacy as legacy
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.gemv_loop import check_loop_keys, k_loop, loop_form
from kernels_src.gguf_gemv_common import _Decode

FORMATS = {q: (GGUF[q].block_size, GGUF[q].type_size) for q in (*legacy.LEGACY_QTYPES, *kquants.K_QTYPES)}
QTYPES = tuple(FORMATS)  # qtype -> (elements, bytes) per block: every quantized type the GGUF loader reads
ALIGN = {"Q4_K": 16, "Q5_K": 16}  # row alignment in bytes that the kernel's loads need (2 for the others)
SUBNORMAL_TARGETS = ("numpy", "triton", "triton-interpret")  # targets with IEEE subnormals at full speed


# Each format has three steps: x_prep (x for one step, once), w_load (one row's raw tiles for the step) and w_dot
# (those tiles and the prepared x to a partial sum), so that the kernel can issue every load of a step first. They
# live by family in kernels_src/gguf_gemv_legacy.py (32-element blocks) and gguf_gemv_kquants.py (super-blocks).

def _family(QTYPE: str, PARTS: int):
    """(tile rank, accumulator shape after STEP, x_prep, w_load, w_dot) of a format."""
    return (kquants.family if QTYPE in kquants.K_QTYPES else legacy.family)(QTYPE, PARTS)


def _gemv_loop(mats, n_rows, n_cols, elems, size, M, ROWS, STEP, PARTS, rank, acc_shape, x_prep, w_load, w_dot,
               PREFETCH: bool = False, STAGES: int = 0):
    """The GEMV's loop over K for the program's ROWS rows of each matrix in `mats` ((w, w_stride) pairs of one
    format and shape, each x_prep shared by all): (rows, accumulators [(i * ROWS + r) * M + m] of matrix i).
    PREFETCH, STAGES: gemv_loop.k_loop's (a step's raw tiles are w_load's, every row's)."""
    n_blk = n_cols // elems
    rows = [tl.program_id(0) * ROWS + r for r in range(ROWS)]
    blocks = tl.arange(0, STEP)
    for _ in range(rank - 1):
        blocks = blocks[:, None]

    def load(it):
        b = it * STEP + blocks
        bmask = b < n_blk
        b = tl.minimum(b, n_blk - 1)  # past the end: re-read the last block, with its scales masked to 0
        starts = [(w + tl.minimum(row, n_rows - 1).to(tl.int64) * w_stride, bmask & (row < n_rows))
                  for w, w_stride in mats for row in rows]
        if getattr(w_load, "by_block", False):  # a word loader: the row's start and the block indices
            return [list(w_load(start, b, mask, PARTS)) for start, mask in starts]
        return [list(w_load(start + b * size, mask, PARTS)) for start, mask in starts]

    def dot(it, raw, accs):
        b = tl.minimum(it * STEP + blocks, n_blk - 1)
        out = list(accs)
        for m in range(M):
            xp = x_prep(m, b)
            for r in range(ROWS * len(mats)):
                out[r * M + m] = out[r * M + m] + w_dot(raw[r], xp)
        return out

    init = tuple(tl.zeros((STEP,) + acc_shape, tl.float32) for _ in range(ROWS * M * len(mats)))
    return rows, k_loop((n_blk + STEP - 1) // STEP, load, dot, init, PREFETCH, STAGES)


def _gemv_body(w, y, n_rows, n_cols, w_stride, y_stride, elems, size, M, ROWS, STEP, PARTS, rank, acc_shape,
               x_prep, w_load, w_dot, PDL: bool = False, PREFETCH: bool = False, STAGES: int = 0):
    """The GEMV. Under PDL the caller's x_prep waits before loading x, after the step's weight loads; PDL waits once
    more before the stores, since a program whose loop runs no step must still wait (a later wait returns at once)."""
    rows, accs = _gemv_loop(((w, w_stride),), n_rows, n_cols, elems, size, M, ROWS, STEP, PARTS, rank, acc_shape,
                            x_prep, w_load, w_dot, PREFETCH, STAGES)
    if PDL:
        tl.wait_prior_grid()
        tl.launch_dependents()
    for r, row in enumerate(rows):
        for m in range(M):
            tl.store(y + m * y_stride + row, tl.sum(accs[r * M + m]), mask=row < n_rows)


def dequant_gemv_kernel(w, x, y, n_rows, n_cols, w_stride, x_stride, y_stride, QTYPE: tl.constexpr, M: tl.constexpr,
                        ROWS: tl.constexpr, STEP: tl.constexpr, PARTS: tl.constexpr, SUBNORMAL: tl.constexpr,
                        PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, STAGES: tl.constexpr = 0):
    """PDL: each step's weight loads are issued before waiting for x (as dequant_gemv_i8_kernel does): in the first
    step they overlap the kernel before; later waits return at once. PREFETCH, STAGES: _gemv_loop's."""
    elems, size = FORMATS[QTYPE]
    rank, acc_shape, x_prep, w_load, w_dot = _family(QTYPE, PARTS)
    dec = _Decode(SUBNORMAL)

    def x_step(m, b):
        if PDL and m == 0 and not STAGES:
            tl.wait_prior_grid()
        return x_prep(x + m * x_stride, b, dec, PARTS)

    if PDL and STAGES:  # the pipeliner would hoist the first steps' x loads above a wait inside the loop
        tl.wait_prior_grid()
    _gemv_body(w, y, n_rows, n_cols, w_stride, y_stride, elems, size, M, ROWS, STEP, PARTS, rank, acc_shape, x_step,
               w_load, lambda raw, xp: w_dot(raw, xp, dec), PDL, PREFETCH, STAGES)


# --- host side -------------------------------------------------------------------------------------------------

# One-warp programs: more of them fit an SM, and one's loads fly while another computes (measured on an H200).
# Q4_K takes one part: 72 registers instead of 98 let 28 warps share an SM, so its 3584 programs at N = 14336 run as
# one wave (at two parts, 19 a SM: 1.4 waves, the last one a tail); 15.3 us against 16.5 on an H200.
# Q5_K, Q2_K and Q3_K take Q4_K's and Q6_K's tiles, Q5_0 and Q5_1 Q4_0's (not yet measured on their own).
LANES = {"Q4_K": 8, "Q5_K": 8, "Q6_K": 8, "Q2_K": 8, "Q3_K": 8, "Q8_0": 4, "Q4_0": 2, "Q4_1": 2, "Q5_0": 2,
         "Q5_1": 2}  # lanes on a block at PARTS = 1
BEST_PARTS = {"Q4_K": 1, "Q5_K": 1, "Q6_K": 1, "Q2_K": 1, "Q3_K": 1, "Q8_0": 2, "Q4_0": 2, "Q4_1": 2, "Q5_0": 2,
              "Q5_1": 2}
# A lane's 4-word vectors of a block at PARTS = 1 (the accumulator's lane axis, 2 // PARTS or 4 // PARTS): PARTS
# divides it.
MAX_PARTS = {q: 2 if q in ("Q4_K", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1") else 4 for q in LANES}
TILE_KEYS = ("ROWS", "STEP", "PARTS", "num_warps")

# (qtype, M, N, K) -> tiles measured best on an H200 by tools/sweep_gemv (its last lines print this literal). The
# int8-activation path (dequant_gemv_i8: the default of Q4_K, Q5_K and Q6_K on Triton) takes ROWS, STEP and
# num_warps, one part a lane (PARTS 1); an entry's int8_x, where present, picks the path on Triton. A problem not
# listed takes rule_tiles. M = 1: `sweep_gemv --budget 75` of 2026-12-03 17:10 UTC over the GEMVs of a Q4_K_M,
# Q5_K_M and Q8_0 Llama-3-8B step (the us: the rule's -> these tiles; where the rule was within 3% it stays): a
# step's GEMVs 2,273 -> 2,033 us (Q4_K_M), 2,774 -> 2,294 (Q5_K_M), 3,107 -> 2,875 (Q8_0). M = 8: the sweep of
# 2026-12-03 14:40 UTC over 4096 x 14336. Q6_K's two word-loader entries: `sweep_gemv --files q4km --types Q6_K
# --quick` of 2026-12-03 22:05 UTC (the us: the earlier entry's tiles -> these, W read as words).
TUNED: dict[tuple[str, int, int, int], dict] = {
    ('Q5_K', 1, 28672, 4096): {'ROWS': 8, 'STEP': 4, 'PARTS': 1, 'num_warps': 1},  # 30.03 -> 26.14
    ('Q8_0', 1, 4096, 14336): {'ROWS': 4, 'STEP': 64, 'PARTS': 4, 'num_warps': 2},  # 29.64 -> 24.18
    ('Q6_K', 1, 4096, 14336): {'ROWS': 2, 'STEP': 4, 'PARTS': 1, 'num_warps': 1, 'words': True},  # 25.38 -> 21.67
    ('Q6_K', 1, 128256, 4096): {'ROWS': 4, 'STEP': 4, 'PARTS': 1, 'num_warps': 1, 'words': True},  # 145.08 -> 127.80
    ('Q8_0', 1, 6144, 4096): {'ROWS': 4, 'STEP': 64, 'PARTS': 4, 'num_warps': 2},  # 11.79 -> 11.43
    ('Q5_K', 1, 4096, 14336): {'ROWS': 4, 'STEP': 8, 'PARTS': 1, 'num_warps': 2},  # 22.02 -> 18.63
    ('Q8_0', 1, 4096, 4096): {'ROWS': 4, 'STEP': 64, 'PARTS': 4, 'num_warps': 2},  # 9.88 -> 8.51
    ('Q4_K', 1, 4096, 14336): {'ROWS': 4, 'STEP': 8, 'PARTS': 1, 'num_warps': 1},  # 17.31 -> 14.31
    ('Q5_K', 1, 4096, 4096): {'ROWS': 2, 'STEP': 4, 'PARTS': 1, 'num_warps': 1},  # 9.86 -> 7.77
    ('Q4_K', 1, 4096, 4096): {'ROWS': 4, 'STEP': 8, 'PARTS': 1, 'num_warps': 1, 'int8_x': False},  # 7.41 -> 6.83
    ('Q5_K', 1, 6144, 4096): {'ROWS': 2, 'STEP': 4, 'PARTS': 1, 'num_warps': 1},  # 11.00 -> 8.95
    ('Q5_K', 1, 5120, 4096): {'ROWS': 2, 'STEP': 4, 'PARTS': 1, 'num_warps': 1},  # 10.58 -> 8.24
    ('Q4_K', 1, 6144, 4096): {'ROWS': 2, 'STEP': 4, 'PARTS': 1, 'num_warps': 1},  # 8.48 -> 8.07
    ('Q6_K', 1, 1024, 4096): {'ROWS': 2, 'STEP': 8, 'PARTS': 1, 'num_warps': 2, 'int8_x': False},  # 9.14 -> 4.91
    ('Q6_K', 8, 4096, 14336): {'ROWS': 2, 'STEP': 8, 'PARTS': 1, 'num_warps': 2, 'int8_x': False},  # 182.79 -> 158.16
    ('Q5_K', 8, 4096, 14336): {'ROWS': 2, 'STEP': 8, 'PARTS': 1, 'num_warps': 2, 'int8_x': False},  # 187.15 -> 147.86
}


TUNED_ENV = "LLM_ENGINE_GEMV_TUNED"  # a JSON file of tools/sweep_gemv --json: another GPU's table, over this one's


def load_tuned(path: str) -> dict[tuple[str, int, int, int], dict]:
    """The entries of a `sweep_gemv --json` file, {(qtype, M, N, K): tiles}, each checked (ValueError naming a bad
    one)."""
    import json

    try:
        rows = json.loads(open(path).read())
        table = {(str(q).upper(), int(m), int(n), int(k)): dict(t) for (q, m, n, k), t in rows}
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{TUNED_ENV}={path}: not a sweep_gemv --json table ({e})") from e
    for (q, *_), tiles in table.items():
        check_tiles(q, tiles)
    return table


def rule_tiles(qtype: str, m: int, n: int) -> dict:
    """ROWS, STEP, PARTS and num_warps by the rule: a warp's lanes cover STEP blocks, and a lane's words and x for
    every batch row stay in registers (fewer rows and parts as M grows)."""
    qtype = qtype.upper()
    parts = BEST_PARTS[qtype] if m <= 2 else 1
    # Two rows a program at 5-8 batch rows: 1.6-1.8x faster at M = 8 than one for Q2_K-Q6_K and Q5_0 on an H200
    # (tools/sweep_gemv, 2026-12-01; Q4_K 74 -> 47 us on 14336 x 4096). M = 3-4 is not measured yet.
    rows = (max(1, 4 // m) if m <= 4 else 2) if n >= 1024 else 1
    return dict(ROWS=rows, STEP=max(1, 32 * parts // LANES[qtype]), PARTS=parts, num_warps=1)


def default_tiles(qtype: str, m: int, n: int, k: int) -> dict:
    """The tiles dequant_gemv takes for x [m, k] and W [n, k]: TUNED's entry for the problem, else rule_tiles."""
    qtype = qtype.upper()
    key = (qtype, m, n, k)
    tuned = _env_tuned().get(key) or TUNED.get(key)
    return dict(tuned) if tuned is not None else rule_tiles(qtype, m, n)


@functools.cache
def _env_tuned() -> dict[tuple[str, int, int, int], dict]:
    """The entries of the file LLM_ENGINE_GEMV_TUNED names (read once): they take precedence over TUNED's."""
    path = os.environ.get(TUNED_ENV)
    return load_tuned(path) if path else {}


def check_tiles(qtype: str, tiles: dict) -> None:
    """Raises ValueError naming what is off in `tiles` (TILE_KEYS, and int8_x where qtype has an int8 path, words
    where that path has a word loader, the loop's prefetch and stages) for qtype: ROWS 1-16, STEP and num_warps
    powers of two (1-128, 1-8), PARTS a divisor of MAX_PARTS (the lane's words of a block)."""
    from kernels_src.dequant_gemv_i8 import I8_QTYPES, WORD_LOADS

    qtype = qtype.upper()
    if sorted(set(tiles) - {"int8_x", "words", "prefetch", "stages"}) != sorted(TILE_KEYS):
        raise ValueError(f"{qtype} tiles {tiles}: keys must be {', '.join(TILE_KEYS)} (and int8_x, words, prefetch, "
                         "stages)")
    if "int8_x" in tiles and (qtype not in I8_QTYPES or not isinstance(tiles["int8_x"], bool)):
        raise ValueError(f"{qtype} tiles {tiles}: int8_x is a bool for {', '.join(I8_QTYPES)} only")
    if "words" in tiles and (qtype not in WORD_LOADS or not isinstance(tiles["words"], bool)):
        raise ValueError(f"{qtype} tiles {tiles}: words is a bool for {', '.join(WORD_LOADS)} only")
    pow2 = lambda v, hi: isinstance(v, int) and 1 <= v <= hi and v & (v - 1) == 0
    bad = [f"ROWS {tiles['ROWS']} (1 to 16)"] if not (isinstance(tiles["ROWS"], int) and 1 <= tiles["ROWS"] <= 16) \
        else []
    bad += [] if pow2(tiles["STEP"], 128) else [f"STEP {tiles['STEP']} (a power of two, 1 to 128)"]
    bad += [] if pow2(tiles["num_warps"], 8) else [f"num_warps {tiles['num_warps']} (a power of two, 1 to 8)"]
    parts = tiles["PARTS"]
    if not (isinstance(parts, int) and parts >= 1 and MAX_PARTS[qtype] % parts == 0):
        bad.append(f"PARTS {parts} (a divisor of {MAX_PARTS[qtype]})")
    bad += check_loop_keys(tiles)
    if bad:
        raise ValueError(f"{qtype} tiles {tiles}: {'; '.join(bad)}")


def _addr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


def _aligned_rows(w, rb: int, align: int):
    """w, or a copy whose rows start `align`-byte aligned where w's do not (the kernel's wide loads need it)."""
    if _addr(w) % align == 0 and (elem_stride(w, 0) % align == 0 or w.shape[0] == 1):
        return w
    shape = (w.shape[0], -(-rb // align) * align)
    out = w.new_zeros(shape) if hasattr(w, "new_zeros") else np.zeros(shape, np.uint8)
    out[:, :rb] = w[:, :rb]
    return out


def aligned_x(x2):
    """x2 [M, K], or a copy of it where its rows are not contiguous and 8-byte aligned: x is read in 8-byte words."""
    if elem_stride(x2, 1) != 1 or _addr(x2) % 8 or (x2.shape[0] > 1 and elem_stride(x2, 0) % 4):
        return x2.contiguous().clone() if hasattr(x2, "clone") else np.array(x2, order="C", copy=True)
    return x2


def dequant_gemv(x, w, qtype: str, *, out=None, rows: int | None = None, step: int | None = None,
                 parts: int | None = None, num_warps: int | None = None, target: str = "numpy",
                 int8_x: bool | None = None, pdl: bool | None = None, words: bool | None = None,
                 prefetch: bool | None = None, stages: int | None = None, xq_d: tuple | None = None):
    """y [M, N] = x [M, K] @ dequantize(w).T for raw GGUF blocks w (uint8 [N, row_bytes]); M <= 8; x may be 1-d.

    int8_x (default: dequant_gemv_i8.uses_int8): x quantized to int8 per 32 elements first, then integer dot
    products (kernels_src/dequant_gemv_i8.py); y then differs from the fp32 path by that quantization.
    pdl (default: dsl.use_pdl) applies to the fp32 path; the int8 path's GEMV is a PDL launch wherever use_pdl says.
    words (int8 path, dequant_gemv_i8.WORD_LOADS' formats; default: TUNED's words, else dequant_gemv_i8.WORDS, where
    the rows allow it): W read as 32-bit words. prefetch, stages (both paths; default: TUNED's, else
    gemv_loop.PREFETCH / STAGES): the K loop's form (kernels_src/gemv_loop.py). xq_d: x already quantized as
    quantize_x does (kernels_src/x_int8), used where the int8 path runs, ignored on the fp32 path."""
    qtype = qtype.upper()
    if qtype not in FORMATS:
        raise ValueError(f"unsupported qtype {qtype!r} (supported: {', '.join(QTYPES)})")
    vec = len(x.shape) == 1
    x2 = x[None] if vec else x
    m, k = x2.shape
    n = w.shape[0]
    rb = row_bytes(qtype, k) if k % FORMATS[qtype][0] == 0 else -1
    if m > 8 or rb <= 0 or w.shape[1] < rb or elem_stride(w, 1) != 1:
        raise ValueError(f"x [{m}, {k}] and {qtype} weights {tuple(w.shape)} do not make a GEMV of M <= 8")
    w = _aligned_rows(w, rb, ALIGN.get(qtype, 2))
    x2 = aligned_x(x2)
    out = empty(x2, (m, n)) if out is None else out
    out2 = out[None] if len(out.shape) == 1 else out
    cfg = default_tiles(qtype, m, n, k)
    given = {key: v for key, v in zip(TILE_KEYS, (rows, step, parts, num_warps), strict=True) if v is not None}
    if given:
        cfg.update(given)
        check_tiles(qtype, cfg)
    from kernels_src import dequant_gemv_i8 as i8  # the int8 path builds on this module's helpers
    tuned_i8 = cfg.pop("int8_x", None)  # TUNED's choice of path, where it was timed: on I8_TARGETS
    int8_x = i8.uses_int8(qtype, target, tuned_i8 if int8_x is None and target in i8.I8_TARGETS else int8_x)
    tuned_words = cfg.pop("words", None)
    prefetch, stages = loop_form({key: cfg.pop(key) for key in ("prefetch", "stages") if key in cfg}, prefetch, stages)
    if words and not int8_x:
        raise ValueError(f"words: only the int8-activation path of {', '.join(i8.WORD_LOADS)} reads W as words")
    if words is None:  # TUNED's choice (or the default) where the rows allow it; an explicit True is checked
        words = (i8.WORDS if tuned_words is None else tuned_words) and int8_x and i8.word_rows(w, qtype, k)
    nw = cfg.pop("num_warps")
    grid = tl.cdiv(n, cfg["ROWS"])
    if int8_x:
        i8.gemv_i8(x2, w, out2, qtype, cfg["ROWS"], cfg["STEP"], nw, target, words, prefetch, stages, xq_d)
        return out[0] if vec and len(out.shape) == 2 else out
    pdl = use_pdl(target, pdl)
    kern = compile(dequant_gemv_kernel, target, num_warps=nw, launch_pdl=pdl, QTYPE=qtype, M=m,
                   SUBNORMAL=target in SUBNORMAL_TARGETS, PDL=pdl, PREFETCH=prefetch, STAGES=stages, **cfg)
    kern[grid](w, x2, out2, n, k, elem_stride(w, 0), elem_stride(x2, 0), elem_stride(out2, 0))
    return out[0] if vec and len(out.shape) == 2 else out


def dequant_gemv_ref(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    """x @ W.T in fp32 with W decoded by our numpy dequantizer."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    return x @ dequantize(np.ascontiguousarray(w[:, :row_bytes(qtype, k)]), qtype, (w.shape[0], k)).T
