"""MMQ variants of gguf_mmq.mmq for Q4_K / Q6_K: "per256" (one x scale a super-block, the super-block's MMAs combined in
int32, fp32 entered once a super-block and output) and "per32p" (per32's arithmetic with per256's Q4_K decoding).

gguf_mmq's first kernels ("per32") quantize x per 32 elements, so every K = 32 MMA's int32 tile is converted and
scaled in fp32 before the next (the sm_90 SASS: 96-128 I2FP, 128 FFMA and 96 FMUL a super-block against 8 IGMMA).
Here x is quantized per 256 elements (quantize_x256_kernel: one d per super-block, as ggml's Q8_K, plus sum(q) per
32), so a super-block's dots share one x scale and add up exactly in int32:
- Q4_K: sub-block j's dot is d sc_j dx sum(q xq) - dmin mn_j dx sum(xq). The low nibbles are `v & 15`; the high
  ones are taken as `(v & 0xF0) ^ 0x80` = 16 q - 128 (an int8), so both operands come from byte-wise AND/XOR, which
  the compiler does on 4 packed bytes at once (a shift of uint8 lanes is unpacked byte by byte: 114 PRMT a
  super-block in the per32 kernel). Hence S = sum_even 16 sc_j D_j + sum_odd sc_j D_j in int32 (one IMAD an
  output and sub-block), y += d dx S / 16, and the minimums plus the high nibbles' offset (+128 sum(xq) per odd
  sub-block): sum_j (8 d sc_j [j odd] - dmin mn_j) sum(xq_j), an FFMA an output and sub-block at 16 rows, two
  [BLOCK_N, 16] @ [16, BLOCK_M] fp16 MMAs a super-block from MMA_MINS_ROWS (exact: integer operands, sums of x's q
  split in fp16-exact pairs, products and sums below 2**24).
  |S| <= 4 (16 * 63 * 15 * 127 * 32) + 4 (63 * 128 * 127 * 32) < 3.8e8 < 2**31.
- Q6_K: its sixteen 16-element dots (gguf_mmq's masked halves) times their int8 scales add up in int32
  (|S| <= 16 * 128 * 32 * 127 * 16 < 1.4e8), y += d dx S.
Accuracy: x moves by at most half its super-block's step, max|x| / 254 over 256 elements instead of 32
(int8_error_bound(.., group=256)): on Gaussian x the error of y is 1.2x per32's; an outlier costs its whole
super-block precision: on SmolLM2's ffn_down inputs 1.9-2.8x per32's, as large as Q4_K's own weight error
(docs/BENCHMARKS.md, 2026-12-03 evening). llama.cpp's CPU k-quant dot products quantize x to Q8_K the same way.
"""

from __future__ import annotations

import numpy as np

from kernels_src.dequant_gemv_i8 import _ONES, _absmax, _quantize
from kernels_src.dsl import compile, elem_stride, empty, tl
from kernels_src.gguf_gemv_common import _x_vals
from kernels_src.gguf_mmq import _finish, _program, _q4k_head, _q6k_head, _q6k_quants

__all__ = ["KERNELS", "MMA_MINS_ROWS", "SUPER_BLOCKS", "pre_pass", "q4k_super_block", "q6k_super_block",
           "quantize_x256", "quantize_x256_ref"]

GROUP = 256  # x elements a scale
# From this BLOCK_M the Q4_K minimums' sums go through fp16 MMAs (sm_90 SASS a super-block, 16 / 32 rows: FFMAs
# 555 / 809 instructions, MMAs 592 / 706).
MMA_MINS_ROWS = 32


def quantize_x256_kernel(x, xq, xd, xs, x_stride, xq_stride, xd_stride, xs_stride, SPLIT: tl.constexpr = False):
    """x [M, K] to int8 q [M, K], fp32 d [M, K / 256] (max|x| / 127 of each 256 elements) and the sums of q of each
    32 in xs: fp32 [M, K / 32], or (SPLIT, for an fp16 MMA) fp16 [M, K / 16] pairs (64 floor(sum / 64), sum mod
    64), each exact in fp16 (|sum| <= 4064 is not); program (super-block, row)."""
    tl.launch_dependents()  # the GEMM after this may start now: it waits for q before its first x load
    m, sb = tl.program_id(1), tl.program_id(0)
    blk = 8 * sb + tl.arange(0, 8)[:, None]  # the super-block's 32-element blocks
    quad = 8 * blk + tl.arange(0, 8)[None, :]  # [8, 8]: 4 elements each
    vals = _x_vals(x + m * x_stride, quad, 4)
    amax = tl.max(_absmax(vals, (-1,)), axis=0, keep_dims=True)  # [1, 1]
    word, d = _quantize(vals, amax)
    tl.store(xq.to(tl.pointer_type(tl.uint32)) + m * (xq_stride // 4) + quad, word)
    tl.store(xd + m * xd_stride + sb + tl.zeros((1, 1), tl.int32), d)
    sums = tl.sum(tl.dot4(_ONES, word, 0), axis=-1, keep_dims=True)  # [8, 1] int32
    if SPLIT:
        low, half = sums & 63, tl.arange(0, 2)[None, :]
        tl.store(xs + m * xs_stride + 2 * blk + half, tl.where(half == 0, sums - low, low).to(tl.float16))
    else:
        tl.store(xs + m * xs_stride + blk, sums.to(tl.float32))


def quantize_x256(x, target: str = "numpy", split: bool = False):
    """(int8 q [M, K], fp32 d [M, K / 256], sum(q) per 32: fp32 [M, K / 32] or, split, fp16 [M, K / 16] pairs) of
    x [M, K] (K a multiple of 256)."""
    m, k = x.shape
    xq, xd = empty(x, (m, k), "int8"), empty(x, (m, k // GROUP), "float32")
    xs = empty(x, (m, k // 16), "float16") if split else empty(x, (m, k // 32), "float32")
    compile(quantize_x256_kernel, target, num_warps=1, SPLIT=split)[k // GROUP, m](
        x, xq, xd, xs, elem_stride(x, 0), elem_stride(xq, 0), elem_stride(xd, 0), elem_stride(xs, 0))
    return xq, xd, xs


def pre_pass(x2, qtype: str, block_m: int, target: str):
    """The x pre-pass mmq_sb_*_kernel reads at BLOCK_M (Q4_K from 32 rows: split sums)."""
    return quantize_x256(x2, target, split=qtype == "Q4_K" and block_m >= MMA_MINS_ROWS)


def quantize_x256_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_x256 in numpy (fp32 arithmetic): (int8 q [M, K], d [M, K / 256])."""
    x = np.asarray(x, np.float32)
    b = x.reshape(x.shape[0], -1, GROUP)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int8).reshape(x.shape)
    return q, (amax[..., 0] * np.float32(1 / 127)).astype(np.float32)


def _high_nibbles(v):
    """16 q - 128 for the high nibbles q of bytes v, as int8 bits: an AND and an XOR (no byte shift)."""
    return (v & 0xF0) ^ 0x80


def _scale_words(words):
    """Q4_K's 6-bit scales and mins packed a byte each, 4 to a word (as llama.cpp unpacks them): (sc 0-3, sc 4-7,
    mn 0-3, mn 4-7) from the three words of scale bytes: sub-blocks 4-7 take 4 bits from byte j + 4 and their top 2
    from bits 6-7 of byte j - 4 (scales) or j (mins)."""
    w0, w1, w2 = words
    return (w0 & 0x3F3F3F3F, (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030),
            w1 & 0x3F3F3F3F, ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030))


def _byte_f32(word, k: int):
    """Byte k of a word as fp32, without a conversion instruction: its bits under 2**23's exponent, minus 2**23."""
    return (((word >> (8 * k)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


def _per_sub_block(w_lo, w_hi, k16, odd_only: bool):
    """fp16 [BLOCK_N, 16]: column k holds byte k // 2 of the packed words (w_lo: sub-blocks 0-3, w_hi: 4-7), the
    order of x's split sums; odd_only: zero for even sub-blocks."""
    j = k16 // 2
    byte = (tl.where(j < 4, w_lo[:, None], w_hi[:, None]) >> (8 * (j % 4))) & 0xFF
    if odd_only:
        byte = tl.where((j % 2) == 1, byte, 0)
    return byte.to(tl.float16)


def q4k_super_block(blk, xrow, srow, drow, sb, BLOCK_M: int, BLOCK_N: int):
    """Super-block sb's term of y.T [BLOCK_N, BLOCK_M] (W @ x.T): blk the W rows' Q4_K super-blocks sb (4-byte
    aligned), xrow x's K-major int8 pointers [32, BLOCK_M] at super-block 0, srow / drow x's rows of pre_pass's sums
    and scales [BLOCK_M]. The dense GEMM and the grouped MoE (moe_mmq.py) share it."""
    e, k16 = tl.arange(0, 32), tl.arange(0, 16)
    d, dmin, words = _q4k_head(blk)
    scs = _scale_words(words)
    isum, mins = tl.zeros((BLOCK_N, BLOCK_M), tl.int32), None
    for c in range(4):
        v = tl.load(blk[:, None] + 16 + 32 * c + e[None, :])  # [BLOCK_N, 32] bytes
        for h in range(2):
            j = 2 * c + h
            q = _high_nibbles(v) if h else (v & 15)
            dot = tl.dot(q.to(tl.int8, bitcast=True), tl.load(xrow + sb * 256 + 32 * j))
            sw, mw, b = scs[j // 4], scs[2 + j // 4], j % 4
            sc = ((sw >> (8 * b)) & 0xFF) if h else ((sw << 4) >> (8 * b)) & 0xFF0  # 16 sc for the low nibbles
            isum = isum + dot * sc.to(tl.int32)[:, None]
            if BLOCK_M < MMA_MINS_ROWS:  # (8 d sc_j [j odd] - dmin mn_j) sum(xq_j): an FFMA an output
                coef = dmin * _byte_f32(mw, b)
                coef = (8.0 * d * _byte_f32(sw, b) - coef) if h else -coef
                term = coef[:, None] * tl.load(srow + sb * 8 + j)[None, :]
                mins = term if mins is None else mins + term
    part = (d * 0.0625)[:, None] * isum.to(tl.float32)
    if BLOCK_M >= MMA_MINS_ROWS:  # the same sums as two [BLOCK_N, 16] @ [16, BLOCK_M] fp16 MMAs, exact
        xsum = tl.load(srow[None, :] + 16 * sb + k16[:, None])  # sum(xq_j) split at rows 2j, 2j + 1
        t_sc = tl.dot(_per_sub_block(scs[0], scs[1], k16[None, :], True), xsum)
        mins = (8.0 * d)[:, None] * t_sc - dmin[:, None] * tl.dot(_per_sub_block(scs[2], scs[3], k16[None, :],
                                                                                 False), xsum)
    return tl.load(drow + sb)[None, :] * (part + mins)


def q6k_super_block(blk, xrow, srow, drow, sb, BLOCK_M: int, BLOCK_N: int):
    """q4k_super_block for Q6_K super-blocks (2-byte aligned): gguf_mmq.mmq_q6k_kernel's quants and masked
    half-chunk MMAs, their int8 scales applied in int32, fp32 entered once (srow unused: no minimums)."""
    e = tl.arange(0, 32)
    first = (e < 16)[None, :]
    d, sc = _q6k_head(blk)
    isum = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    for j, si, q in _q6k_quants(blk, e):
        xv = tl.load(xrow + sb * 256 + 32 * j)
        for u in range(2):
            part = tl.dot(tl.where(first if u == 0 else ~first, q, 0).to(tl.int8), xv)
            isum = isum + part * tl.load(sc + si + u).to(tl.int32)[:, None]
    return (d[:, None] * tl.load(drow + sb)[None, :]) * isum.to(tl.float32)


# the super-block's term and its bytes, by qtype
SUPER_BLOCKS = {"Q4_K": (q4k_super_block, 144), "Q6_K": (q6k_super_block, 210)}


def mmq_sb_q4k_kernel(w, xq, xd, xs, y, m_rows, n_rows, w_stride, xq_stride, xd_stride, xs_stride, y_stride,
                      split_stride, n_steps, steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PDL: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 0):
    """Program (i, j, s) as gguf_mmq.mmq_q4k_kernel, on pre_pass's output: xd one scale a super-block, xs the sums
    of each 32 elements' q (split in fp16 pairs from MMA_MINS_ROWS)."""
    m, n, wrow, mc, xrow, lo = _program(m_rows, n_rows, w, xq, w_stride, xq_stride, steps_per_split, BLOCK_M,
                                        BLOCK_N, PDL)
    drow, srow = xd + mc * xd_stride, xs + mc * xs_stride

    def step(sb, acc):
        return acc + q4k_super_block(wrow + sb * 144, xrow, srow, drow, sb, BLOCK_M, BLOCK_N)

    _finish(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, BLOCK_M, BLOCK_N,
            LOOP_STAGES)


def mmq_sb_q6k_kernel(w, xq, xd, xs, y, m_rows, n_rows, w_stride, xq_stride, xd_stride, xs_stride, y_stride,
                      split_stride, n_steps, steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PDL: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 0):
    """mmq_sb_q4k_kernel for Q6_K: q6k_super_block a step (xs unused)."""
    m, n, wrow, mc, xrow, lo = _program(m_rows, n_rows, w, xq, w_stride, xq_stride, steps_per_split, BLOCK_M,
                                        BLOCK_N, PDL)
    drow = xd + mc * xd_stride

    def step(sb, acc):
        return acc + q6k_super_block(wrow + sb * 210, xrow, None, drow, sb, BLOCK_M, BLOCK_N)

    _finish(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, BLOCK_M, BLOCK_N,
            LOOP_STAGES)


KERNELS = {"Q4_K": mmq_sb_q4k_kernel, "Q6_K": mmq_sb_q6k_kernel}


def mmq_p32_q4k_kernel(w, xq, xd, xs, y, m_rows, n_rows, w_stride, xq_stride, xd_stride, y_stride, split_stride,
                       n_steps, steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 0):
    """gguf_mmq.mmq_q4k_kernel's arithmetic (x per 32: quantize_x's d and d * sum(q), strided alike) with this
    file's decoding: high nibbles as 16 q - 128, scales and mins from packed words."""
    m, n, wrow, mc, xrow, lo = _program(m_rows, n_rows, w, xq, w_stride, xq_stride, steps_per_split, BLOCK_M,
                                        BLOCK_N, PDL)
    e = tl.arange(0, 32)
    drow, srow = xd + mc * xd_stride, xs + mc * xd_stride

    def step(sb, acc):
        blk = wrow + sb * 144
        d, dmin, words = _q4k_head(blk)
        scs = _scale_words(words)
        for c in range(4):
            v = tl.load(blk[:, None] + 16 + 32 * c + e[None, :])
            for h in range(2):
                j = 2 * c + h
                q = _high_nibbles(v) if h else (v & 15)
                dot = tl.dot(q.to(tl.int8, bitcast=True), tl.load(xrow + sb * 256 + 32 * j)).to(tl.float32)
                sc, mn = _byte_f32(scs[j // 4], j % 4), _byte_f32(scs[2 + j // 4], j % 4)
                coef = (8.0 * d * sc - dmin * mn) if h else -dmin * mn
                scale = (d * sc * (0.0625 if h else 1.0))[:, None] * tl.load(drow + sb * 8 + j)[None, :]
                acc = acc + dot * scale + coef[:, None] * tl.load(srow + sb * 8 + j)[None, :]
        return acc

    _finish(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, BLOCK_M, BLOCK_N,
            LOOP_STAGES)
