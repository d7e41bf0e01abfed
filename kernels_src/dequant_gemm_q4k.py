"""dequant_gemm's variant "sub64" for Q4_K: a K step is one 32-byte run of a super-block's quants (its sub-blocks 2p
and 2p + 1: the low and high nibbles), gathered a 32-bit word an element in the [BLOCK_N, 64] order the dot takes.

Why (the sm_90 AOT build of variant "blocked" at 64 x 128, 8 warps, 3 stages; docs/ARCHITECTURE.md has the rest):
there the super-block's 6-bit scales and fp16 d / dmin are 1- and 2-byte loads, which Triton's pipeliner leaves
synchronous (cp.async moves 4 bytes at least): every step waits on them. Here every load of W is a 32-bit word
(Q4_K's 144-byte blocks are whole words), so all of it can be staged ahead with cp.async, and element e of the step
is field 8 * (e % 4) + 4 * (e // 32) of word 4 + 8p + (e % 32) // 4 (L1 serves each word's 8 readers): no reshape.
A row's two (scale, min) pairs of the step come from three scale words by scalar shifts (ggml's get_scale_min_k4).
"""

from __future__ import annotations

from kernels_src.dequant_gemm import word_tile
from kernels_src.dsl import tl
from kernels_src.gguf_gemv_common import _f16
from kernels_src.split_k import split_k_tile

BLOCK_WORDS = 36  # a Q4_K super-block: d, dmin (1 word), 12 scale bytes (3), 128 quant bytes (32)
STEP = 64  # inputs a step: a super-block's sub-blocks 2p, 2p + 1


def _byte(word, i):
    return (word >> (8 * i)) & 0xFF


def scale_min(blk, p, half: int):
    """(scale, min) 6-bit codes [N, 1] of sub-block j = 2p + half of the super-blocks at blk (int32 word pointers)."""
    j = 2 * p + half
    a = _byte(tl.load(blk + 2 + p // 2), (j + 4) % 4)  # scales[j + 4]
    b = _byte(tl.load(blk + 1), j % 4)  # scales[j % 4]
    c = _byte(tl.load(blk + 1 + p // 2), j % 4)  # scales[j]
    low = j < 4
    sc = tl.where(low, b & 63, (a & 15) | ((b >> 6) << 4))
    mn = tl.where(low, a & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


def dequant_gemm_q4k_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                            steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr,
                            PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (STEP inputs each);
    w: the Q4_K rows as int32 words [N, >= row_words] (w_stride in words); y output or fp32 partials."""
    m, n, wrow, xrow = word_tile(w, x, m_rows, n_rows, w_stride, x_stride, BLOCK_M, BLOCK_N, STEP, PDL)
    e = tl.arange(0, STEP)
    word = (4 + (e % 32) // 4)[None, :]  # the step's word of element e, past 8p
    shift = (8 * (e % 4) + 4 * (e // 32))[None, :]
    first = (e < 32)[None, :]
    lo = tl.program_id(2) * steps_per_split

    def step(it, acc):
        p = it % 4
        blk = wrow + (it // 4) * BLOCK_WORDS
        q = ((tl.load(blk + 8 * p + word) >> shift) & 15).to(tl.float32)  # [N, STEP]
        head = tl.load(blk)
        d, dmin = _f16(head), _f16(head >> 16)
        sc0, mn0 = scale_min(blk, p, 0)
        sc1, mn1 = scale_min(blk, p, 1)
        scale = tl.where(first, d * sc0, d * sc1)
        sub = tl.where(first, dmin * mn0, dmin * mn1)
        wv = (q * scale - sub).to(xrow.dtype.element_ty)
        xv = tl.load(xrow + it * STEP)
        return tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)
