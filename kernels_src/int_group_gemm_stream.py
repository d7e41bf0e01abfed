"""int_group_gemm's variant "stream": W's packed words go from the load to the MMA's register operand without a
reshape, so the sm_90 build streams them (cp.async, 3-4 stages) and decodes in registers, Marlin's idea in Triton.

- A step of BK inputs takes one [BLOCK_N, C] tile of q words (C = BK / PER, PER = 32 / BITS fields a word) and splits
  it by field: field j of every word is a [BLOCK_N, C] tile in the words' own layout, one `dot` of depth C each
  (PER dots a step). Field j of word c is input c * PER + j of the step, so x is read in that order: the launcher
  hands the kernel x permuted once per call (`permute_x`: a step's inputs j * C + c hold x's c * PER + j), whose
  [BLOCK_M, C] slices are then plain contiguous loads. Variant "blocked" shifts the fields out along a new axis and
  reshapes, which the build turns into a round trip through shared memory every step (and 4 lanes reading each word).
- A field decodes without I2F (a quarter-rate conversion on sm_90): each 16-bit half of a word, ORed once under
  the fp32 exponent of 2^23, reads as 2^23 + its bits; a field masked out of it with the exponent (one LOP3) less
  2^23 is q * 2^at exactly (at: the field's place in the half), and the step's scale divided by 2^at once a row
  makes q * scale + bias in fp32 the same value as "blocked" computes, rounded once to x's dtype.
- Scales and biases: one [BLOCK_N, 1] pair a step when the step lies in one group, else a pair per word column.
"""

from __future__ import annotations

from kernels_src.dequant_gemm import word_tile
from kernels_src.dsl import tl
from kernels_src.split_k import store_tile

STREAM_BK = 128  # inputs a step: 16 words a row at 4 bits (the dot's least depth), 32 at 8
MIN_DEPTH = 16  # a dot's least depth for 16-bit inputs: words a row a step
ACC_REGS = 64  # fp32 accumulator registers a thread may hold (8 fields x 16 x 64 at 4 warps: 129 in all; 32 x 64: 246)

MAGIC = (127 + 23) << 23  # the fp32 exponent of 2^23: mantissa bit 0 worth 1
KEEP = 0x7F800000  # an fp32's exponent bits


def halves(words):
    """(low, high) 16 bits of each word under MAGIC's exponent: fp32s 2^23 + the half's bits, fields in place."""
    return (words & 0xFFFF) | MAGIC, ((words >> 16) & 0xFFFF) | MAGIC


def field_q(lo, hi, j: int, BITS: int):
    """q * 2^at of field j (the half's bits at.. hold it) as exact fp32, and at; the caller scales by 2^-at."""
    half = 16 // BITS
    src, at = (lo, BITS * j) if j < half else (hi, BITS * (j - half))
    return (src & (KEEP | (((1 << BITS) - 1) << at))).to(tl.float32, bitcast=True) - 8388608.0, at


def int_group_gemm_stream_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                                 steps_per_split, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, ACCS: tl.constexpr = 1,
                                 PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (BK inputs each);
    w int32 words [N, row_words]; x permuted by permute_x; y output or fp32 partials. Field j's dot adds into
    accumulator j % ACCS (ACCS 1, or PER: then no dot of a step waits for another, see accs_for)."""
    PER = 32 // BITS
    C = BK // PER  # q words a row a step
    GW = GROUP // PER  # q words a group
    BW = 2 + GW  # words a group block: scale, bias, q words
    m, n, wrow, xrow = word_tile(w, x, m_rows, n_rows, w_stride, x_stride, BLOCK_M, BLOCK_N, C, PDL)
    c = tl.arange(0, C)
    lo = tl.program_id(2) * steps_per_split

    def step(it, *accs):
        accs = list(accs)
        k0 = it * BK
        if GROUP == BK:  # a group a step: its offsets known 8-byte aligned, so the words load 8 bytes a vector
            blk = wrow + it * BW
            words = tl.load(blk + 2 + c[None, :])
        elif GROUP % BK == 0:  # a slice of one group: its words contiguous, one scale and bias a row
            blk = wrow + (k0 // GROUP) * BW
            words = tl.load(blk + 2 + (k0 % GROUP) // PER + c[None, :])
        else:  # a scale and bias a word column (groups shorter than the step, or not dividing it)
            kw = k0 // PER + c  # the columns' q-word indices within the row
            blk = wrow + ((kw // GW) * BW)[None, :]
            words = tl.load(blk + 2 + (kw % GW)[None, :])
        scale = tl.load(blk).to(tl.float32, bitcast=True)
        bias = tl.load(blk + 1).to(tl.float32, bitcast=True)
        lo_half, hi_half = halves(words)
        for j in tl.static_range(PER):
            q, at = field_q(lo_half, hi_half, j, BITS)
            wv = (q * (scale * (1.0 / (1 << at))) + bias).to(xrow.dtype.element_ty)
            xv = tl.load(xrow + k0 + j * C)  # x's inputs c * PER + j of the step (permute_x)
            a = j % ACCS
            accs[a] = tl.dot(wv, tl.trans(xv), accs[a]) if SWAP else tl.dot(xv, tl.trans(wv), accs[a])
        return tuple(accs)

    shape = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    accs = tl.fori_loop(lo, tl.minimum(lo + steps_per_split, n_steps), step,
                        tuple(tl.zeros(shape, tl.float32) for _ in range(ACCS)))
    acc = accs[0]
    for more in accs[1:]:
        acc = acc + more
    store_tile(acc, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)


def stream_fits(bits: int, k: int) -> bool:
    """Whether the default stream step tiles a row of k inputs at `bits` bits."""
    try:
        stream_bk(bits, k)
    except ValueError:
        return False
    return True


def stream_bk(bits: int, k: int, bk: int | None = None) -> int:
    """The step (STREAM_BK unless given), checked: whole words a row at least MIN_DEPTH deep, a power of two of
    them, and dividing the row."""
    bk = bk or STREAM_BK
    words = bk // (32 // bits)
    if bk % (32 // bits) or words < MIN_DEPTH or words & (words - 1) or k % bk:
        raise ValueError(f"a stream step of {bk} inputs does not tile a row of {k} at {bits} bits (it takes a "
                         f"power of two of {MIN_DEPTH} or more q words, {MIN_DEPTH * 32 // bits} inputs at least, "
                         "dividing the row)")
    return bk


def accs_for(bits: int, block_m: int, block_n: int, num_warps: int, swap: bool) -> int:
    """PER accumulators where they fit ACC_REGS registers a thread and W is the register operand, else 1. Triton
    waits for a dot at once when another dot of the loop body reads its result (8 small wgmmas in a row at 4 bits);
    one loop-carried accumulator a field leaves each dot read only by the next step's, so they stay in flight."""
    per = 32 // bits
    return per if swap and per * block_m * block_n <= ACC_REGS * 32 * num_warps else 1


def permute_x(x2, bk: int, bits: int):
    """x [M, K] in the order the stream kernel reads it: within each step of bk inputs, position j * C + c holds
    input c * PER + j (C = bk / PER words, PER fields a word); a contiguous copy (numpy or torch alike)."""
    per = 32 // bits
    m, k = x2.shape
    return x2.reshape(m, k // bk, bk // per, per).swapaxes(2, 3).reshape(m, k)
