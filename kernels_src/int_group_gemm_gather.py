"""int_group_gemm's variant "gather": each weight element loads its own q word, so the tile comes out of the load in
the [BLOCK_N, BK] order the dot takes (the classic Triton GPTQ kernel's trick, written afresh here).

Element (row r, input k) is field (k % GROUP) % PER of word (k // GROUP) * BW + 2 + (k % GROUP) // PER of row r
(PER = 32 / BITS fields a word, BW words a group block). The [BLOCK_N, BK] tile of word pointers repeats each word
PER times (L1 serves the repeats); shift and mask give q without the [.., PER] axis and reshape that variant
"blocked" (int_group_gemm_kernel) needs, which the sm_90 build turned into a layout conversion through shared
memory every step. Every load is a 32-bit word, so Triton's pipeliner can stage all of them with cp.async.
Scales and biases: one per row a step when BK divides GROUP, else one per (row, input), gathered the same way.
"""

from __future__ import annotations

from kernels_src.dequant_gemm import word_tile
from kernels_src.dsl import tl
from kernels_src.split_k import split_k_tile


def gather_q(words, k, BITS: int, GROUP: int):
    """q of inputs k (within-group offsets k % GROUP) from their words, as unsigned ints."""
    PER = 32 // BITS
    return (words >> (((k % GROUP) % PER) * BITS)) & ((1 << BITS) - 1)


def int_group_gemm_gather_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                                 steps_per_split, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                                 PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (BK inputs each;
    BK divides GROUP or is a multiple of it); w int32 words [N, row_words]; y output or fp32 partials."""
    PER = 32 // BITS
    BW = 2 + GROUP // PER  # words a group block: scale, bias, q words
    m, n, wrow, xrow = word_tile(w, x, m_rows, n_rows, w_stride, x_stride, BLOCK_M, BLOCK_N, BK, PDL)
    kk = tl.arange(0, BK)
    lo = tl.program_id(2) * steps_per_split

    def step(it, acc):
        k = it * BK + kk  # [BK] inputs of the step
        words = tl.load(wrow + ((k // GROUP) * BW + 2 + (k % GROUP) // PER)[None, :])  # [N, BK], each word PER x
        q = gather_q(words, k[None, :], BITS, GROUP)
        if BK <= GROUP:  # one group a step: a scale and bias a row
            blk = wrow + ((it * BK) // GROUP) * BW
        else:
            blk = wrow + ((k // GROUP) * BW)[None, :]
        scale = tl.load(blk).to(tl.float32, bitcast=True)
        bias = tl.load(blk + 1).to(tl.float32, bitcast=True)
        wv = (q.to(tl.float32) * scale + bias).to(xrow.dtype.element_ty)
        xv = tl.load(xrow + it * BK)
        return tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)
