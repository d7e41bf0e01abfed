"""dequant_gemm's variant "stream" for Q4_K: a K step is CHUNKS of a super-block's four 64-input chunks, its BLOCK_N
rows' quant bytes of them one 2-D tile of 32-bit words [BLOCK_N, 8 CHUNKS] (16-byte vectors: 144-byte blocks keep
16-byte alignment), decoded in registers in x's stored order, so a step is one dot over x as stored.

Why (the sm_90 AOT builds of variant "words", docs/ARCHITECTURE.md): its loads are all cp.async'd already, but x
is staged in the decoder's [M, 1, 4, 32] piece shape, read back from shared memory, reshaped and written again for
wgmma's B operand (two round trips a step), and each wgmma is waited for at once. Here nibble h of byte i of quant
word (c, j) is input 64c + 32h + 4j + i (ggml's layout), so the [BLOCK_N, CHUNKS, 2, 8, 4] tile (c, h, j, i) read
row-major is the step's inputs in order, and x's cp.async buffer is wgmma's B as it lies (sm_90 build: no x round
trip, one wgmma left in flight). A value is its nibble masked where it lies in the word (bytes 2, 3: in the word
shifted down 16 bits, so fields stay under bit 23), OR-ed into 2**23's mantissa (an exact float, no int-to-float
conversion), less 2**23, times d * scale over the field's power of two, less dmin * min; the (scale, min) pairs
are decoded on an [N, 2 CHUNKS] tile from the header's words, as in dequantize._k4_scales. Under fp16 / bf16 x the
values are made in x's type instead (quant_tile_half: the nibble in the mantissa of 1024 / 128, d * scale and
dmin * min rounded to x's type, one fma an element pair: sm_90's HFMA2, no conversion step); bf16's rms error on
random rows is then ~1.5x blocked's, 3.4e-3 against 2.3e-3 of the output (bf16 y), the scales' own rounding.
Rows past N are clamped (read again, not stored); no load is masked.
"""

from __future__ import annotations

from kernels_src import dequantize as dq
from kernels_src.dequant_gemm import word_tile
from kernels_src.dsl import tl
from kernels_src.split_k import split_k_tile

BLOCK_WORDS = 36  # a Q4_K super-block: d, dmin (1 word), 12 scale bytes (3), 128 quant bytes (32)


def quant_tile(words):
    """[N, C, 2, 8, 4] fp32 quants of [N, C, 1, 8, 1] int32 quant words (c, j), each times 2**(8 (i % 2) + 4h): nibble
    h of byte i masked where it lies in the word, or (bytes 2 and 3) in the word shifted down 16 bits, so that every
    field stays under bit 23, inside 2**23's mantissa; one shift serves 8 values."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    field = tl.where(i >= 2, words >> 16, words) & (15 << (8 * (i % 2) + 4 * h))
    return (field | dq.MAGIC).to(tl.float32, bitcast=True) - float(2 ** 23)


HALF_MAGIC = {"bf16": (0x4300, 128.0), "fp16": (0x6400, 1024.0)}  # 2**7, 2**10: an integer under it in the mantissa


def quant_tile_half(words, dtype):
    """quant_tile in x's 16-bit float type, times HALF_SCALE: nibble h of byte i, shifted down to bit 0 (bf16: 7
    mantissa bits) or masked where it lies in the byte (fp16: 10), OR-ed into the mantissa of 128 or 1024, less
    that: exact."""
    magic, base = HALF_MAGIC[dtype.name]
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    if dtype.name == "bf16":
        field = (words >> (8 * i + 4 * h)) & 0x0F
    else:
        field = (words >> 8 * i) & tl.where(h == 1, 0xF0, 0x0F)
    return (field | magic).to(tl.uint16).to(dtype, bitcast=True) - base


def half_scale(dtype):
    """[1, 1, 2, 1, 1]: 1 / quant_tile_half's factor of nibble h."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    return tl.where(h == 1, 1.0 if dtype.name == "bf16" else 0.0625, 1.0)


def field_scale():
    """[1, 1, 2, 1, 4]: 1 / quant_tile's factor of nibble h of byte i."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    return tl.where(i % 2 == 1, 2.0 ** -8, 1.0) * tl.where(h == 1, 0.0625, 1.0)


def scales(blk, p, CHUNKS: int):
    """(d * scale, dmin * min) [N, CHUNKS, 2, 1, 1] of sub-block 2 (CHUNKS p + c) + h, from the header's four words
    at blk [N, 1]: decoded as an [N, 2 CHUNKS] tile (a few a thread), then broadcast."""
    s = tl.arange(0, 2 * CHUNKS)[None, :]
    head = tl.load(blk)
    sw = [tl.load(blk + i) for i in (1, 2, 3)]
    ds, dm = dq._k4_scales(None, CHUNKS * p + s // 2, s % 2, dq._half(head), dq._half(head >> 16), sw)
    return tl.reshape(ds, (ds.shape[0], CHUNKS, 2, 1, 1)), tl.reshape(dm, (dm.shape[0], CHUNKS, 2, 1, 1))


def dequant_gemm_stream_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                               steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr,
                               CHUNKS: tl.constexpr = 4, PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (64 CHUNKS inputs
    each: CHUNKS of a super-block's four 64-input chunks); w: the Q4_K rows as int32 words [N, >= row_words]
    (w_stride in words); y output or fp32 partials."""
    per_block = 4 // CHUNKS  # steps a super-block
    m, n, wrow, xrow = word_tile(w, x, m_rows, n_rows, w_stride, x_stride, BLOCK_M, BLOCK_N, 64 * CHUNKS, PDL)
    quant = 4 + tl.arange(0, 8 * CHUNKS)[None, :]  # the step's quant words past 8 CHUNKS p: (c, j) at 8c + j
    lo = tl.program_id(2) * steps_per_split

    def step(it, acc):
        p = it % per_block
        blk = wrow + (it // per_block) * BLOCK_WORDS
        ds, dm = scales(blk, p, CHUNKS)
        words = tl.reshape(tl.load(blk + 8 * CHUNKS * p + quant), (BLOCK_N, CHUNKS, 1, 8, 1))
        xt = xrow.dtype.element_ty
        if xt.name in HALF_MAGIC:  # in x's type: half the arithmetic (two values an instruction), no rounding step
            wv = quant_tile_half(words, xt) * (ds * half_scale(xt)).to(xt) - dm.to(xt)
        else:
            wv = quant_tile(words) * (ds * field_scale()) - dm
        wv = tl.reshape(wv, (BLOCK_N, 64 * CHUNKS)).to(xt)
        xv = tl.load(xrow + it * (64 * CHUNKS))
        return tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)
