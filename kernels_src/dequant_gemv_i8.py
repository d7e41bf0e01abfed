"""Dequantizing GEMV on int8 activations (llama.cpp's mmvq), for Q4_K, Q5_K and Q6_K; built on dequant_gemv.py's
helpers.

On Triton (I8_TARGETS), for Q4_K: quantize_x_kernel turns x into int8 q and
one fp32 scale d = max|x| / 127 per 32 elements (a Q4_K sub-block), then dequant_gemv_i8_kernel dots each 32-bit
word of nibbles, masked into its low and high nibbles, with two int8 x words through dp4a (`tl.dot4`): 4 products
an instruction, scales and mins once per lane and sub-block in fp32. The GEMV is a programmatic dependent launch:
it starts while the pre-pass runs and issues its first weight loads before waiting for q (`tl.wait_prior_grid`).
H200, 14336 x 4096, bf16 x: 11.8-11.9 us (65-66% of copy) against 14.8-15.2 us for the fp32 kernel; without PDL
13.8 us (the second launch's latency), the int8 GEMV alone 11.5-12.1 us. Quantizing x inside the GEMV (every
program redoing all of K) instead: 16.8 us at 4 rows, 15.5 at 8. y moves by x's quantization: |dy| <=
sum_k |W[n, k]| d_k / 2 (int8_error_bound); relative to |y| about 0.5% on random data.
The int8 GEMV compiles to 456 SASS instructions a loop step at 64 registers, the fp32 one to 712 at 72.
Q6_K the same way (its fields as unsigned bytes, the -32 through sums of q): at ROWS 4, STEP 4 the whole kernel is
566 SASS instructions at 80 registers against the fp32 kernel's 958 at 123 (sm_90 AOT; not yet timed on a GPU, where
the fp32 one reads at 40-69% of copy). Q5_K: Q4_K's with the fifth bits from qh, 526 at 78 against 844 at 95.
"""

from __future__ import annotations

import numpy as np

from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src.dequant_gemv import FORMATS, _addr, _gemv_body
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.gguf_gemv_common import _f16, _u16, _words, _x_vals
from kernels_src.gguf_gemv_kquants import _chunks, _halves, _q4k_load, _q4k_scales, _q5k_load

# --- Q4_K with int8 activations (llama.cpp's mmvq): dp4a on nibble words against int8 x words ------------------
# x is quantized per 32-element block (the sub-block of Q4_K): q = round(x / d), d = max|x| / 127. Word j of chunk c
# holds, in its low nibbles, sub-block 2c's elements 4j..4j+3 (x word 16c + j of the super-block) and in its high
# nibbles sub-block 2c + 1's (x word 16c + 8 + j): w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F against those two x
# words are two dp4a. Scales and mins apply once per lane and sub-block in fp32; the min term uses sum(q) * d.
_ONES = 0x01010101
_MAGIC = 12582912.0  # 1.5 * 2**23: v + _MAGIC holds round(v) (to nearest even) in its low mantissa bits, |v| < 2**22


def _xq_words(words, d):
    """(x words [STEP, 4, lanes, 4] as uint32, d [STEP, 4, 1, 1], the lane's sum(q) * d) for one sub-block."""
    return words, d, d * tl.sum(tl.dot4(_ONES, words, 0), axis=-1, keep_dims=True).to(tl.float32)


def _q4k_xq_load(xq, xd, sb):
    """x prepared by quantize_x_kernel: int8 words and per-32 scales."""
    quad = 64 * sb + 16 * _chunks() + _words(8, 1, 4)[0]
    xw, blk = xq.to(tl.pointer_type(tl.uint32)), 8 * sb + 2 * _chunks()
    return (_xq_words(tl.load(xw + quad), tl.load(xd + blk)),
            _xq_words(tl.load(xw + quad + 8), tl.load(xd + blk + 1)))


def _quantize(vals, amax):
    """(int8 x words: the 4 tiles `vals` are bytes 0..3, d): q = round(v * 127 / amax)."""
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    word = 0
    for k, v in enumerate(vals):
        byte = (v * inv + _MAGIC).to(tl.uint32, bitcast=True) & 0xFF
        word = byte if k == 0 else word | (byte << (8 * k))
    return word, amax * (1.0 / 127.0)


def _absmax(vals, axes=(-1, -2)):
    """max |v| over the tiles `vals` and `axes` (the 32 elements of a block), dims kept."""
    m = tl.abs(vals[0])
    for v in vals[1:]:
        m = tl.maximum(m, tl.abs(v))
    for a in axes:
        m = tl.max(m, axis=a, keep_dims=True)
    return m


def _q4k_dot_i8(raw, xp):
    w = raw[0]
    return _k4_dot_i8(w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F, raw, xp)


def _q5k_dot_i8(raw, xp):
    """Q4_K's with each byte's fifth bit from qh (bit 2c of qh's byte for the low fields, 2c + 1 for the high)."""
    w, t = raw[0], raw[1] >> (2 * _chunks())
    return _k4_dot_i8((w & 0x0F0F0F0F) | ((t << 4) & 0x10101010), ((w >> 4) & 0x0F0F0F0F) | ((t << 3) & 0x10101010),
                      raw, xp)


def _k4_dot_i8(q_lo, q_hi, raw, xp):
    """Q4_K's and Q5_K's partial sum from their unsigned low- and high-sub-block bytes and the block's head."""
    (xl, dl, sl), (xh, dh, sh) = xp
    il = tl.sum(tl.dot4(q_lo, xl, 0), axis=-1, keep_dims=True).to(tl.float32)
    ih = tl.sum(tl.dot4(q_hi, xh, 0), axis=-1, keep_dims=True).to(tl.float32)
    d, dmin, sc, mn = _q4k_scales(raw[-2], raw[-1])
    lo, hi = lambda t: (t & 0xFF).to(tl.float32), lambda t: (t >> 8).to(tl.float32)
    return d * (lo(sc) * (dl * il) + hi(sc) * (dh * ih)) - dmin * (lo(mn) * sl + hi(mn) * sh)


# --- Q6_K with int8 activations: the 6-bit fields as unsigned bytes, dp4a against int8 x ----------------------------
# Element 128h + 32k + l (half h, field k, l < 32) is nibble k // 2 of ql[64h + 32 (k % 2) + l] with bits 2k, 2k + 1
# of qh[32h + l] on top, minus 32; scale 8h + 2k + l // 16. Lane g of a half (4 lanes) takes l = 8g .. 8g + 7: words
# 2g, 2g + 1 of the half's ql, ql + 32 and qh, each field k a LOP3 or two from them into a word of 4 unsigned bytes
# (0-63), one dp4a per word against x's int8 word; the -32 comes off once per lane and field as 32 sum(q). The
# 210-byte super-blocks are only 2-byte aligned, so a 32-bit word is two 16-bit loads. x's 32-element block 4h + k
# holds the lane's 8 elements of field k, so one x scale serves each (lane, field).

def _q6k_lane():
    return tl.arange(0, 4)[None, None, :, None]


def _q6k_word():
    """The lane's two words (of 4 l each) in its half: [1, 1, 4 lanes, 2]."""
    return 2 * _q6k_lane() + tl.arange(0, 2)[None, None, None, :]


def _u32_at(w16, word):
    """32-bit words `word` from a 2-byte aligned base (16-bit halves, little-endian)."""
    return _u16(w16 + 2 * word) | (_u16(w16 + 2 * word + 1) << 16)


def _q6k_i8_load(blk, mask, PARTS: int):
    h, w16, j = _halves(), blk.to(tl.pointer_type(tl.uint16)), _q6k_word()
    raw = [_u32_at(w16 + 32 * h, j), _u32_at(w16 + 32 * h + 16, j), _u32_at(w16 + 64 + 16 * h, j)]  # ql, +32, qh
    return raw + [_u16(w16 + 96 + 4 * h + k, mask) for k in range(4)] + [_u16(w16 + 104, mask)]  # scales, d


# WORDS (tile key `words`): the same fields read as 32-bit words from the row's 4-byte aligned start. Block b starts
# at byte 210 b, 2 mod 4 for odd b, so a field at byte f (f % 4 == 0) of the block is the funnel of aligned words
# (210 b + f) // 4 and the next, shifted down 16 (210 b) % 4 bits: 3 word loads a lane and array against 4 16-bit
# loads, the scales 3 words against 4, d 1. Rows must start 4-byte aligned and hold an even number of blocks: then
# every word read lies in the row (an even block's last word reaches into the odd block after it).

def _funnel(lo, hi, sh):
    """The 32 bits at bit sh (0 or 16) of the pair hi:lo, as a 64-bit shift: ptxas makes it one funnel shift (SHF),
    where three 32-bit shifts and an OR made the loop 20% longer."""
    return (((hi.to(tl.uint64) << 32) | lo.to(tl.uint64)) >> sh.to(tl.uint64)).to(tl.uint32)


def _q6k_i8_words_load(row, b, mask, PARTS: int):
    """_q6k_i8_load's tiles from 32-bit words: row, the row's first byte; b, the step's block indices."""
    h, j, w32 = _halves(), _q6k_word(), row.to(tl.pointer_type(tl.uint32))
    off = b * 210
    base, sh = w32 + (off >> 2), ((off & 2) << 3).to(tl.uint32)
    first = tl.arange(0, 2)[None, None, None, :] == 0

    def pair(at):  # the lane's two words at word `at` + j of the block: three loads, the middle one shared
        lo = tl.load(base + at + j)
        hi = tl.where(first, tl.sum(tl.where(first, 0, lo), axis=-1, keep_dims=True),
                      tl.load(base + at + 2 * _q6k_lane() + 2))
        return _funnel(lo, hi, sh)

    raw = [pair(16 * h), pair(16 * h + 8), pair(32 + 8 * h)]  # ql, ql + 32, qh
    sc = [tl.load(base + 48 + 2 * h + i, mask=mask, other=0) for i in range(3)]  # scale bytes 8h ..
    lo_hi = [_funnel(sc[0], sc[1], sh), _funnel(sc[1], sc[2], sh)]
    d = (tl.load(base + 52, mask=mask, other=0) >> sh) & 0xFFFF
    return raw + [(lo_hi[k // 2] >> (16 * (k % 2))) & 0xFFFF for k in range(4)] + [d]


_q6k_i8_words_load.by_block = True  # _gemv_loop passes it (row pointer, block indices) instead of block pointers


def _q6k_xq_load(xq, xd, sb):
    """Per field k: (x words [STEP, 2, 4, 2], their block's d [STEP, 2, 1, 1], 32 sum(q) over the lane's 8)."""
    xw, h, out = xq.to(tl.pointer_type(tl.uint32)), _halves(), []
    for k in range(4):
        words = tl.load(xw + 64 * sb + 32 * h + 8 * k + _q6k_word())
        out.append((words, tl.load(xd + 8 * sb + 4 * h + k), tl.sum(tl.dot4(0x20202020, words, 0), axis=-1,
                                                                     keep_dims=True)))
    return out


def _q6k_dot_i8(raw, xp):
    a, b, qh = raw[:3]
    six = ((a & 0x0F0F0F0F) | ((qh << 4) & 0x30303030), (b & 0x0F0F0F0F) | ((qh << 2) & 0x30303030),
           ((a >> 4) & 0x0F0F0F0F) | (qh & 0x30303030), ((b >> 4) & 0x0F0F0F0F) | ((qh >> 2) & 0x30303030))
    shift = _q6k_lane() // 2 * 8  # the lane's byte (l // 16) of each 16-bit scale word
    acc = 0.0
    for k in range(4):
        words, d, sum32 = xp[k]
        dot = tl.sum(tl.dot4(six[k], words, 0), axis=-1, keep_dims=True)
        sc = (raw[3 + k] >> shift).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
        acc = acc + (sc * d) * (dot - sum32).to(tl.float32)
    return _f16(raw[-1]) * acc


def quantize_x_kernel(x, xq, xd, xs, n_cols, x_stride, xq_stride, xd_stride, BLOCKS: tl.constexpr,
                      SUMS: tl.constexpr = False):
    """x [M, K] to int8 q [M, K] and fp32 d [M, K / 32] per 32-element block (grid: K / (32 BLOCKS), M); SUMS:
    also d * sum(q) per block into xs (strided as xd), what a block's minimum meets (llama.cpp's Q8_1 keeps it)."""
    tl.launch_dependents()  # the GEMV after this may start now: it loads weights until it needs x
    m = tl.program_id(1)
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    ok = blk < n_cols // 32
    blk = tl.minimum(blk, n_cols // 32 - 1)
    quad = 8 * blk + tl.arange(0, 8)[None, :]
    vals = _x_vals(x + m * x_stride, quad, 4)
    amax = _absmax(vals, (-1,))
    word, d = _quantize(vals, amax)
    tl.store(xq.to(tl.pointer_type(tl.uint32)) + m * (xq_stride // 4) + quad, word, mask=ok)
    tl.store(xd + m * xd_stride + blk, d, mask=ok)
    if SUMS:
        sums = tl.sum(tl.dot4(_ONES, word, 0), axis=-1, keep_dims=True).to(tl.float32)
        tl.store(xs + m * xd_stride + blk, d * sums, mask=ok)


I8_FAMILY = {"Q4_K": (_q4k_xq_load, _q4k_load, _q4k_dot_i8, (4, 2, 1)),
             "Q5_K": (_q4k_xq_load, _q5k_load, _q5k_dot_i8, (4, 2, 1)),
             "Q6_K": (_q6k_xq_load, _q6k_i8_load, _q6k_dot_i8, (2, 4, 1))}  # x load, w_load, w_dot, acc shape
WORD_LOADS = {"Q6_K": _q6k_i8_words_load}  # formats whose int8 path has a word-reading variant (tile key words)
WORDS = False  # the default where the rows allow it: not until tools/sweep_gemv times it on a GPU


def dequant_gemv_i8_kernel(w, xq, xd, y, n_rows, n_cols, w_stride, xq_stride, xd_stride, y_stride,
                           QTYPE: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr,
                           PDL: tl.constexpr = False, WORDS: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                           STAGES: tl.constexpr = 0):
    """dequant_gemv_kernel on int8 activations from quantize_x_kernel (Q4_K, Q5_K, Q6_K). PDL: launched as a
    programmatic dependent launch, so each step's weight loads are issued before waiting for quantize_x's output
    (in the first step that overlaps the pre-pass; later waits return at once). WORDS: WORD_LOADS' loader.
    PREFETCH, STAGES: _gemv_loop's (the next step's W loads before this step's arithmetic; Triton's pipelining)."""
    elems, size = FORMATS[QTYPE]
    x_load, w_load, w_dot, acc_shape = I8_FAMILY[QTYPE]
    if WORDS:
        w_load = WORD_LOADS[QTYPE]

    def x_prep(m, b):
        if PDL and m == 0 and not STAGES:
            tl.wait_prior_grid()
        return x_load(xq + m * xq_stride, xd + m * xd_stride, b)

    if PDL and STAGES:  # the pipeliner would hoist the first steps' x loads above a wait inside the loop
        tl.wait_prior_grid()
    _gemv_body(w, y, n_rows, n_cols, w_stride, y_stride, elems, size, M, ROWS, STEP, 1, 4, acc_shape, x_prep,
               w_load, w_dot, PREFETCH=PREFETCH, STAGES=STAGES)


I8_QTYPES = tuple(I8_FAMILY)  # formats with an int8-activation path
I8_DEFAULT = I8_QTYPES  # those that take it by default (TUNED's int8_x may say otherwise for a problem)
I8_TARGETS = ("triton",)  # targets where I8_DEFAULT take it by default (dp4a; the SIMT targets keep fp32 x)


def uses_int8(qtype: str, target: str, int8_x: bool | None = None) -> bool:
    """Whether dequant_gemv takes the int8-activation path (int8_x None: the default for qtype and target)."""
    if int8_x is None:
        return qtype.upper() in I8_DEFAULT and target in I8_TARGETS
    if int8_x and qtype.upper() not in I8_QTYPES:
        raise ValueError(f"int8_x: only {', '.join(I8_QTYPES)} have an int8-activation path, not {qtype}")
    return bool(int8_x)


def quantize_x(x, xq=None, xd=None, target: str = "numpy", sums: bool = False):
    """(int8 q [M, K], fp32 d [M, K / 32]) of x [M, K] per 32-element block: q = round(x * 127 / max|x|); sums:
    (q, d, d * sum(q) [M, K / 32])."""
    m, k = x.shape
    xq = empty(x, (m, k), "int8") if xq is None else xq
    xd = empty(x, (m, k // 32), "float32") if xd is None else xd
    xs = empty(x, (m, k // 32), "float32") if sums else xd
    blocks = 8
    compile(quantize_x_kernel, target, num_warps=1, BLOCKS=blocks, SUMS=sums)[tl.cdiv(k // 32, blocks), m](
        x, xq, xd, xs, k, elem_stride(x, 0), elem_stride(xq, 0), elem_stride(xd, 0))
    return (xq, xd, xs) if sums else (xq, xd)


def traces(x_dtype: str = "bf16", m: int = 1, pdl: bool = True, qtypes: tuple = I8_QTYPES) -> list:
    """The pre-pass and the int8 GEMV of each of qtypes traced at dequant_gemv's rule tiles (AOT and parse checks)."""
    from kernels_src.dequant_gemv import rule_tiles

    gemv = dict(w="*u8", xq="*i8", xd="*fp32", y=f"*{x_dtype}", n_rows="i32", n_cols="i32", w_stride="i32",
                xq_stride="i32", xd_stride="i32", y_stride="i32")
    prep = dict(x=f"*{x_dtype}", xq="*i8", xd="*fp32", xs="*fp32", n_cols="i32", x_stride="i32", xq_stride="i32",
                xd_stride="i32")
    return [compile(quantize_x_kernel, "numpy", BLOCKS=8).trace(signature=prep),
            *(compile(dequant_gemv_i8_kernel, "numpy", QTYPE=q, M=m, ROWS=t["ROWS"], STEP=t["STEP"],
                      PDL=pdl).trace(signature=gemv) for q in qtypes for t in [rule_tiles(q, m, 14336)])]


def word_rows(w, qtype: str, k: int) -> bool:
    """Whether W's rows suit qtype's word loader: 4-byte aligned starts and an even number of blocks."""
    return qtype in WORD_LOADS and (k // FORMATS[qtype][0]) % 2 == 0 and not (
        _addr(w) % 4 or (w.shape[0] > 1 and elem_stride(w, 0) % 4))


def gemv_i8(x2, w, out2, qtype: str, rows: int, step: int, num_warps: int, target: str,
            words: bool = False, prefetch: bool = False, stages: int = 0, xq_d: tuple | None = None) -> None:
    """dequant_gemv's int8 path: quantize_x, then the integer GEMV (one lane part whatever PARTS says); words: W
    through WORD_LOADS' loader (word_rows must hold); prefetch, stages: the loop's form (gemv_loop.k_loop); xq_d:
    x already quantized (x_int8's fused norm / activation wrote it), so no quantize_x launch."""
    m, k = x2.shape
    n = w.shape[0]
    if words and qtype not in WORD_LOADS:
        raise ValueError(f"words: only {', '.join(WORD_LOADS)} have a word loader, not {qtype}")
    if words and not word_rows(w, qtype, k):
        raise ValueError(f"words: {qtype} rows {tuple(w.shape)} (stride {elem_stride(w, 0)}, {k} inputs) must start "
                         f"4-byte aligned and hold an even number of blocks")
    xq, xd = quantize_x(x2, target=target) if xq_d is None else xq_d
    pdl = use_pdl(target)
    kern = compile(dequant_gemv_i8_kernel, target, num_warps=num_warps, launch_pdl=pdl, QTYPE=qtype, M=m, ROWS=rows,
                   STEP=step, PDL=pdl, WORDS=bool(words), PREFETCH=prefetch, STAGES=stages)
    kern[tl.cdiv(n, rows)](w, xq, xd, out2, n, k, elem_stride(w, 0), elem_stride(xq, 0), elem_stride(xd, 0),
                           elem_stride(out2, 0))


def quantize_x_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_x in numpy (fp32 arithmetic): (int8 q [M, K], d [M, K / 32])."""
    x = np.asarray(x, np.float32)
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int8).reshape(x.shape)
    return q, (amax[..., 0] * np.float32(1 / 127)).astype(np.float32)


def dequantize_x(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    return (q.reshape(q.shape[0], -1, 32).astype(np.float32) * d[..., None]).reshape(q.shape)


def int8_error_bound(x: np.ndarray, w: np.ndarray, qtype: str, group: int = 32) -> np.ndarray:
    """|y_int8 - y| per output [M, N] from quantizing x alone (one scale a `group` elements): round-to-nearest
    moves each x by at most d / 2 (its block's step), so |sum_k W[n, k] (xq - x)[k]| <= sum_k |W[n, k]| d[k] / 2
    (fp32 rounding of d aside)."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    wd = dequantize(np.ascontiguousarray(w[:, :row_bytes(qtype, k)]), qtype, (w.shape[0], k))
    step = np.repeat(np.abs(x).reshape(x.shape[0], -1, group).max(-1) / 127, group, axis=-1)
    return 0.5 * step.astype(np.float64) @ np.abs(wd.astype(np.float64)).T
