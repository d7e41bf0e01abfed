"""dequant_gemm's variant "stream" for Q6_K: dequant_gemm_stream's shape (a step's weights as 2-D tiles of 32-bit
words, decoded in x's stored order, one dot over x as stored) over 210-byte blocks, which are only 2-byte aligned.

Why: the blocked kernel reads Q6_K's quants, scales and d as bytes and 16-bit halves (its blocks are 2-byte aligned),
which Triton's pipeliner leaves synchronous (cp.async moves 4 bytes at least): its sm_90 build at 16 x 64 waits on 49
`ld.global.b16` + 8 `ld.global.b8` a step; only x is cp.async'd. Here every load is a 32-bit word: block b starts
2 (b % 2) bytes past word 52 b + b // 2 of its row (rows start 4-byte aligned), so its word f is that word f (even
b) or the funnel of words f and f + 1 shifted 16 bits (odd b), and no word read leaves the block.
Element 128 hh + 64 n + 32 kk + 16 g + 4 j + i of a block (x's order: the tile [N, hh, n, kk, g, j, i] row-major)
is nibble n of byte i of ql word 16 hh + 8 kk + 4 g + j, with bits 2 (2n + kk) + {0, 1} of byte i of qh word
8 hh + 4 g + j on top, minus 32, times d * scale[8 hh + 4 n + 2 kk + g]. The qh word shifted left 4 - 2 kk bits puts
those two bits just above the nibble in every byte at once, so a 6-bit value is two masks where it lies (bytes 2, 3
from the words shifted down 16 bits, to stay under bit 23), OR-ed into 2**23's mantissa as in dequant_gemm_stream.
"""

from __future__ import annotations

from kernels_src import dequantize as dq
from kernels_src.dequant_gemm import word_tile
from kernels_src.dsl import tl
from kernels_src.split_k import split_k_tile

QL, QH, SCALES, D = 0, 32, 48, 52  # a block's word offsets (d: the low half of word 52, in its own frame)


def _axis(size: int, at: int):
    """arange(size) along axis `at` of the 7-d tile [N, hh, n, kk, g, j, i]."""
    return tl.reshape(tl.arange(0, size), tuple(size if a == at else 1 for a in range(7)))


def block_words(blk, odd, first: int, count: int):
    """[N, count] words first.. of the blocks at blk (word pointers [N, 1] of the word each block starts in): the words
    themselves for even blocks, for odd ones (2 bytes further) the funnel of each word and the next, 16 bits down."""
    f = blk + first + tl.arange(0, count)[None, :]
    lo = tl.load(f)
    return tl.where(odd, ((lo >> 16) & 0xFFFF) | (tl.load(f + 1) << 16), lo)


def quant_tile(ql, qh, n):
    """[N, HH, NN, 2, 2, 4, 4] fp32 (q - 32) * 2**p of ql words [N, HH, 1, 2, 2, 4, 1], qh words [N, HH, 1, 1, 2, 4,
    1] and the tile's nibbles n [1, 1, NN, 1, ...]: the 6 bits in place at p = 8 (i % 2) + 4n of the word (bytes 2, 3
    of the words shifted down 16 bits first). The arithmetic shifts' sign bits land above every mask."""
    kk, i = _axis(2, 3), _axis(4, 6)
    high = i >= 2
    at = 8 * (i % 2) + 4 * n
    low = tl.where(high, ql >> 16, ql) & (15 << at)
    top = (tl.where(high, qh >> 16, qh) << (4 - 2 * kk)) & (48 << at)
    return ((low | top) | dq.MAGIC).to(tl.float32, bitcast=True) - (2.0 ** 23 + (32 << at).to(tl.float32))


def scales(sw, d, HH: int, NN: int):
    """d * scale [N, HH, NN, 2, 2, 1, 1] of the step's scale words sw [N, HH * NN] (int8 scale 4 w + b in byte b of
    word w: (kk, g) = divmod(b, 2)); d [N, 1] fp32."""
    b = tl.arange(0, 4)[None, None, :]
    sc = ((sw[:, :, None] << (24 - 8 * b)) >> 24).to(tl.float32)  # the signed byte b
    return tl.reshape(sc * d[:, :, None], (sw.shape[0], HH, NN, 2, 2, 1, 1))


def dequant_gemm_stream_q6k_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                                   steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   SWAP: tl.constexpr, CHUNKS: tl.constexpr = 4, PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (64 CHUNKS inputs
    each: CHUNKS of a block's four 64-input chunks (hh, n)); w: the Q6_K rows as int32 words [N, >= row_words],
    4-byte aligned (w_stride in words); y output or fp32 partials."""
    per_block = 4 // CHUNKS  # steps a block
    HH, NN = max(1, CHUNKS // 2), min(2, CHUNKS)  # the step's halves, and nibbles of each
    m, n, wrow, xrow = word_tile(w, x, m_rows, n_rows, w_stride, x_stride, BLOCK_M, BLOCK_N, 64 * CHUNKS, PDL)
    lo = tl.program_id(2) * steps_per_split

    def step(it, acc):
        b = it // per_block
        q0 = CHUNKS * (it % per_block)  # the step's first chunk 2 hh + n
        hh0, odd = q0 // 2, b % 2 == 1
        blk = wrow + 52 * b + b // 2
        head = tl.load(blk + D)  # d: bytes 208-209 of the block, in word 52's high half for odd blocks
        d = dq._half(tl.where(odd, head >> 16, head))
        ql = tl.reshape(block_words(blk, odd, QL + 16 * hh0, 16 * HH), (BLOCK_N, HH, 1, 2, 2, 4, 1))
        qh = tl.reshape(block_words(blk, odd, QH + 8 * hh0, 8 * HH), (BLOCK_N, HH, 1, 1, 2, 4, 1))
        nib = q0 % 2 + _axis(NN, 2)
        unit = ((127 - 8 * (_axis(4, 6) % 2) - 4 * nib) << 23).to(tl.float32, bitcast=True)  # 2**-p
        ds = scales(block_words(blk, odd, SCALES + q0, CHUNKS), d, HH, NN)
        wv = tl.reshape(quant_tile(ql, qh, nib) * (ds * unit), (BLOCK_N, 64 * CHUNKS)).to(xrow.dtype.element_ty)
        xv = tl.load(xrow + it * (64 * CHUNKS))
        return tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)
