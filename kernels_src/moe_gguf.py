"""The fused MoE's GEMM over expert stacks kept as GGUF blocks: DSL kernel, its launch, the stacks' reference decoding.

A stack is its raw blocks [E * out, row_bytes] (expert e's rows e * out ..), as the GGUF file and the CUDA backend
hold it (backends.cuda.weights.QuantWeight); any format kernels_src/dequantize.py decodes. The grid and the
grouping are kernels_src/moe.py's (slots grouped by expert on the device, one program a block of BLOCK_M slots of
one expert and BLOCK_N output columns); what differs is how a weight tile reaches the dot, which is
kernels_src/dequant_gemm.py's way: the program's BLOCK_N rows' blocks for one step of K (KB blocks) are one tile of
block pointers, dequantize.py's decoder turns it into (element offsets, values) pieces in registers, and each piece
meets the gathered x elements at the same offsets in one `tl.dot`, W @ x.T: BLOCK_N is the MMA's M dimension and
the dequantized W its register operand (Hopper's wgmma takes A from registers). Nothing is dequantized to memory,
and the launch is as capturable as the dense one.
- GATED: gate and up, which may differ in format, walk K in the same steps (KB_A blocks of one, KB_B of the other
  cover the same elements); of one format, each piece's x is loaded once for both dots.
- K is a whole number of steps (no tail); rows of W past the expert's out are clamped (read again, not stored) and
  padding slots read token row 0, so no load is masked.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ir.formats.gguf_quants import QTYPES as GGUF
from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src import dequantize as dq
from kernels_src.dequant_gemm import STEP_ELEMS, _numel
from kernels_src.dsl import compile, elem_stride, tl
from kernels_src.moe_slots import block_slots, swapped_block_out

__all__ = ["QTYPES", "GGUFStack", "check_stack", "dequantize_stack", "is_blocks", "launch", "moe_qgemm_kernel",
           "pass_tiles", "step_blocks"]

QTYPES = dq.QTYPES


class GGUFStack(NamedTuple):
    """An expert stack as GGUF blocks: data uint8 [E * out, >= row_bytes] (rows 2-byte aligned), its qtype and its
    logical shape (E, out, in). backends.cuda.weights.QuantWeight has the same three fields and passes as one."""

    data: object
    qtype: str
    shape: tuple[int, ...]


def is_blocks(w) -> bool:
    return hasattr(w, "qtype") and hasattr(w, "data")


def _tiles(w, stride, e, n_cols, QTYPE: str, KB: int, BLOCK_N: int, WIDE: bool, WORDS: bool):
    """(block pointers [BLOCK_N * KB, 1, ..] of the program's rows of expert e at step 0, decoder, rank); WORDS:
    Q4_K / Q5_K headers read as 32-bit words (dequantize._k4_head), other formats as they are."""
    rank, decode = dq._family(QTYPE, WIDE, WORDS and QTYPE in dq.WORD_HEADS)
    r = tl.arange(0, BLOCK_N * KB)  # block tile: row r // KB of the program's, block r % KB of the step's
    row = e * n_cols + tl.minimum(tl.program_id(1) * BLOCK_N + r // KB, n_cols - 1)  # past out: the last row
    ptr = w + row.to(tl.int64) * stride + (r % KB) * GGUF[QTYPE].type_size
    for _ in range(rank - 1):
        ptr = ptr[:, None]
    return ptr, decode, rank


def _x_rows(xrow, KB: int, rank: int):
    """x's gathered rows [BLOCK_M, 1, ..] and the step's block index [1, KB, 1, ..] at the decoder's rank + 1."""
    xrow, kb = xrow[:, None], tl.arange(0, KB)[None, :]
    for _ in range(rank - 1):  # x's elements of a piece keep the decoder's contiguous axis
        xrow, kb = xrow[:, :, None], kb[:, :, None]
    return xrow, kb


def _accumulate(accs, ptrs, decode, xrow, kb, b0, QTYPE: str, KB: int, BLOCK_M: int, BLOCK_N: int):
    """accs[i] += W_i's step (blocks b0 .. b0 + KB) times x's matching elements, for weights of one format: each
    piece's x elements loaded once for all of them."""
    elems, size = GGUF[QTYPE].block_size, GGUF[QTYPE].type_size
    accs = list(accs)
    for parts in zip(*(decode(p + b0 * size) for p in ptrs), strict=True):
        off = parts[0][0]
        p = _numel(parts[0][1].shape[1:])
        xv = tl.reshape(tl.load(xrow + (b0 + kb) * elems + off[None]), (BLOCK_M, KB * p))
        for i, (_, val) in enumerate(parts):
            wv = tl.reshape(val, (BLOCK_N, KB * p)).to(xrow.dtype.element_ty)
            accs[i] = tl.dot(wv, tl.trans(xv), accs[i])
    return accs


def moe_qgemm_kernel(x, w_a, w_b, y, rows, block_expert, weights, n_slots, n_cols, n_steps, x_stride, a_stride,
                     b_stride, y_stride, TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                     QTYPE_A: tl.constexpr, QTYPE_B: tl.constexpr, KB_A: tl.constexpr, KB_B: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr = False,
                     WORDS: tl.constexpr = False):
    """Program (b, j): slots rows[b * BLOCK_M ..] (all of expert block_expert[b]), columns BLOCK_N j.. of y.
    GATED: y = act(x[tok] @ A[e].T) * (x[tok] @ B[e].T), tok = slot // TOP_K; else y = (x[slot] @ A[e].T) *
    weights[slot]. A, B: GGUF stacks of n_cols rows an expert; n_steps steps of K (KB_A blocks of A's each). The
    accumulators are [BLOCK_N, BLOCK_M] (W @ x.T). WORDS: Q4_K / Q5_K headers as 32-bit words (stacks 4-byte
    aligned), as dequant_gemm's variant words."""
    if PDL:  # x and the routing come from earlier kernels, and the routing says which weights to read
        tl.wait_prior_grid()
        tl.launch_dependents()
    e, slot, valid, src, n = block_slots(rows, block_expert, n_slots, TOP_K, GATED, BLOCK_M, BLOCK_N)
    xrow = x + src.to(tl.int64) * x_stride
    pa, dec_a, rank_a = _tiles(w_a, a_stride, e, n_cols, QTYPE_A, KB_A, BLOCK_N, WIDE, WORDS)
    xa, kba = _x_rows(xrow, KB_A, rank_a)
    shared = GATED and QTYPE_B == QTYPE_A  # one format: B's pieces meet the same x elements as A's
    if GATED:
        pb, dec_b, rank_b = _tiles(w_b, b_stride, e, n_cols, QTYPE_B, KB_B, BLOCK_N, WIDE, WORDS)
        xb, kbb = _x_rows(xrow, KB_B, rank_b)
    tile = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    def step(it, *accs):
        if shared:
            return tuple(_accumulate(accs, (pa, pb), dec_a, xa, kba, it * KB_A, QTYPE_A, KB_A, **tile))
        acc_a = _accumulate(accs[:1], (pa,), dec_a, xa, kba, it * KB_A, QTYPE_A, KB_A, **tile)
        if not GATED:
            return acc_a[0]
        return acc_a[0], _accumulate(accs[1:], (pb,), dec_b, xb, kbb, it * KB_B, QTYPE_B, KB_B, **tile)[0]

    swapped_block_out(step, rows, n_slots, n_steps, weights, y, slot, valid, src, n, n_cols, y_stride, GATED, ACT,
                      BLOCK_M, BLOCK_N)


# --- host side -------------------------------------------------------------------------------------------------

def _addr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


def check_stack(w, experts: int, out: int, k: int, what: str) -> None:
    """ValueError unless w is a stack of `experts` GGUF matrices [out, k] the kernel can read."""
    qtype = w.qtype.upper()
    if qtype not in QTYPES:
        raise ValueError(f"{what}: unsupported qtype {w.qtype!r} (supported: {', '.join(QTYPES)})")
    data, elems = w.data, GGUF[qtype].block_size
    if tuple(w.shape) != (experts, out, k) or k % elems or len(data.shape) != 2 or data.shape[0] != experts * out \
            or data.shape[1] < row_bytes(qtype, k) or elem_stride(data, 1) != 1:
        raise ValueError(f"{what}: {qtype} stack {tuple(w.shape)} with blocks {tuple(data.shape)} is not "
                         f"[{experts}, {out}, {k}] (blocks [{experts * out}, >= row bytes])")
    if _addr(data) % 2 or elem_stride(data, 0) % 2:
        raise ValueError(f"{what}: rows must start 2-byte aligned (the blocks' fp16 scales are read as such)")


def step_blocks(qtypes, k: int) -> list[int]:
    """Blocks a step of K takes of each format: one step of STEP_ELEMS elements (a whole block at least) that
    divides k, the same elements for every format."""
    least = max(GGUF[q.upper()].block_size for q in qtypes)
    step = max(least, STEP_ELEMS)
    while k % step and step > least:  # block sizes and STEP_ELEMS are powers of two, and least divides k
        step //= 2
    return [step // GGUF[q.upper()].block_size for q in qtypes]


def pass_tiles(qtypes, gated: bool, block_m: int, block_n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a pass at moe.default_tiles' (block_m, block_n). A gated pass holds two accumulators
    and decodes two weight tiles, so its BLOCK_N stops at 32; a k-quant pass of 512 outputs a program or more (and
    Q5_K's gated one) takes 8 warps. So every such build for sm_90 spills nothing (test_aot_sm90)."""
    qtypes = [q.upper() for q in qtypes]
    if gated:
        block_n = min(block_n, 32)
    kquant = any(q.endswith("_K") for q in qtypes)
    wide = block_m * block_n >= 512 or (gated and "Q5_K" in qtypes)
    return block_n, 8 if kquant and wide else 4


# Q4_K / Q5_K headers read as words by default: one layer's grouped Q4_K_M MoE at Qwen3-30B-A3B's stacks, 1,356 ->
# 1,147 us at 64 tokens and 1,393 -> 1,169 at 128 on an H200 (`tools/sweep_moe --variants blocked,words`, 2026-12-03).
WORDS = True


def whole_words(*stacks) -> bool:
    """Whether every stack's rows start 4-byte aligned (what reading headers as 32-bit words needs)."""
    return all(not (_addr(w.data) % 4 or elem_stride(w.data, 0) % 4) for w in stacks)


def launch(src, a, b, dst, rows, block_expert, weights, n_slots: int, k_dim: int, *, gated: bool, top_k: int,
           act: str, block_m: int, block_n: int, target: str, pdl: bool, num_warps: int = 4,
           words: bool | None = None):
    """One pass of the fused MoE over GGUF stacks a (and b when gated): dst [S, n_cols] by slot. words: Q4_K / Q5_K
    headers read as 32-bit words (None: WORDS where the stacks allow it)."""
    qa, qb = a.qtype.upper(), b.qtype.upper()
    if not gated:
        qb = qa
    heads = [w for w in ((a, b) if gated else (a,)) if w.qtype.upper() in dq.WORD_HEADS]  # what words changes
    if words is None:
        words = WORDS and whole_words(*heads)
    elif words and not whole_words(*heads):
        raise ValueError(f"words reads {qa} / {qb} headers as 32-bit words: the stacks' rows (strides "
                         f"{[elem_stride(w.data, 0) for w in heads]}) must start 4-byte aligned")
    kb_a, kb_b = step_blocks((qa, qb), k_dim)
    n_cols = a.shape[1]
    kern = compile(moe_qgemm_kernel, target, num_warps=num_warps, launch_pdl=pdl, TOP_K=top_k, GATED=gated, ACT=act,
                   QTYPE_A=qa, QTYPE_B=qb, KB_A=kb_a, KB_B=kb_b, BLOCK_M=block_m, BLOCK_N=block_n,
                   WIDE=target in dq.WIDE_TARGETS, PDL=pdl, WORDS=bool(words and heads))
    n_steps = k_dim // (kb_a * GGUF[qa].block_size)
    kern[block_expert.shape[0], tl.cdiv(n_cols, block_n)](
        src, a.data, b.data, dst, rows, block_expert, weights, n_slots, n_cols, n_steps, elem_stride(src, 0),
        elem_stride(a.data, 0), elem_stride(b.data, 0), elem_stride(dst, 0))


def dequantize_stack(w) -> np.ndarray:
    """fp32 [E, out, in]: a GGUF stack through our numpy dequantizer (ir/formats/gguf_quants.py)."""
    e, out, k = w.shape
    data = w.data.cpu().numpy() if hasattr(w.data, "cpu") else np.asarray(w.data)
    raw = np.ascontiguousarray(data[:, :row_bytes(w.qtype, k)])
    return dequantize(raw, w.qtype, (e * out, k)).reshape(e, out, k)
