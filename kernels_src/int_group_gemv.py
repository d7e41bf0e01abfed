"""GEMV y[M, N] = x[M, K] @ W.T (M <= 8) straight from integer-group blocks (GPTQ, AWQ, compressed-tensors weights
in the intgroup layout of ir/formats/int_groups.py), and the dequantization of such rows for a cuBLAS GEMM at larger
batches: DSL kernels, launchers, numpy references.

W arrives as int32 words [N, row_words]: each group of GROUP inputs is one block of 2 + GROUP * BITS / 32 words,
[scale f32][bias f32][q words], input j of the group at bits BITS * (j % PER) of q word j // PER (PER = 32 / BITS).
A block decodes as q * scale + bias, so a group contributes scale * sum(q x) + bias * sum(x): the kernel multiplies
by the scale and adds the bias once per lane and group, not once per weight.
- A program takes one row and walks the groups STEP at a time; a step's tile is [STEP, WPB] words (WPB: the
  block's q words rounded up to a power of two, the rest masked), each word's PER fields shifted and masked out,
  each meeting the x values of its inputs, which are loaded PER strided tiles a step.
- x is re-read by every program (from L1/L2: the GEMV is bound by W's bytes, x is M * K values).
More rows take the tensor-core GEMM of int_group_gemm.py.
"""

from __future__ import annotations

import numpy as np

from ir.formats import int_groups
from kernels_src.dsl import compile, elem_stride, tl
from kernels_src.paged_attention import empty

MAX_ROWS = 8


def _words(bits: int, group: int) -> tuple[int, int, int]:
    """(q words a block, WPB: those rounded up to a power of two, words a block)."""
    qw = group * bits // 32
    return qw, tl.next_power_of_2(qw), 2 + qw


def _tiles(STEP: int, BITS: int, GROUP: int):
    """(group offsets [STEP, 1], word offsets [1, WPB]) of a step's tile."""
    return tl.arange(0, STEP)[:, None], tl.arange(0, _words(BITS, GROUP)[1])[None, :]


def _step_blocks(base, it, g, wi, n_groups, BITS: int, GROUP: int, STEP: int):
    """Step `it`'s groups of one row: (their first inputs [STEP, 1], the q words' mask [STEP, WPB], scales and
    biases [STEP, 1] f32, the q fields [PER of STEP, WPB] as f32; field j of word i is input i * PER + j)."""
    QW, _, BW = _words(BITS, GROUP)
    gg = it * STEP + g
    gmask = gg < n_groups
    mask = gmask & (wi < QW)
    blk = base + gg * BW
    scale = tl.load(blk, mask=gmask, other=0).to(tl.float32, bitcast=True)
    bias = tl.load(blk + 1, mask=gmask, other=0).to(tl.float32, bitcast=True)
    qw = tl.load(blk + 2 + wi, mask=mask, other=0)
    qs = [((qw >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32) for j in range(32 // BITS)]
    return gg * GROUP, mask, scale, bias, qs


def int_group_gemv_kernel(w, x, y, n_rows, n_groups, w_stride, x_stride, y_stride, BITS: tl.constexpr,
                          GROUP: tl.constexpr, M: tl.constexpr, STEP: tl.constexpr):
    row = tl.program_id(0)
    PER = 32 // BITS
    g, wi = _tiles(STEP, BITS, GROUP)
    base = w + row.to(tl.int64) * w_stride

    def body(it, *accs):
        first, mask, scale, bias, qs = _step_blocks(base, it, g, wi, n_groups, BITS, GROUP, STEP)
        out = list(accs)
        for m in range(M):
            xrow = x + m * x_stride + first + wi * PER
            xs = [tl.load(xrow + j, mask=mask, other=0.0).to(tl.float32) for j in range(PER)]
            qx, sx = qs[0] * xs[0], xs[0]
            for j in range(1, PER):
                qx, sx = qx + qs[j] * xs[j], sx + xs[j]
            out[m] = out[m] + scale * qx + bias * sx
        return tuple(out)

    init = tuple(tl.zeros((STEP, _words(BITS, GROUP)[1]), tl.float32) for _ in range(M))
    accs = tl.fori_loop(0, (n_groups + STEP - 1) // STEP, body, init)
    for m in range(M):
        tl.store(y + m * y_stride + row, tl.sum(accs[m]))


def int_group_dequantize_kernel(w, out, n_groups, w_stride, out_stride, BITS: tl.constexpr, GROUP: tl.constexpr,
                                STEP: tl.constexpr):
    """One program a row: every weight as q * scale + bias, stored in out's dtype, inputs in stored order."""
    row = tl.program_id(0)
    PER = 32 // BITS
    g, wi = _tiles(STEP, BITS, GROUP)
    base = w + row.to(tl.int64) * w_stride
    dst = out + row.to(tl.int64) * out_stride

    def body(it):
        first, mask, scale, bias, qs = _step_blocks(base, it, g, wi, n_groups, BITS, GROUP, STEP)
        for j in range(PER):
            tl.store(dst + first + wi * PER + j, (qs[j] * scale + bias).to(out.dtype.element_ty), mask=mask)
        return ()

    tl.fori_loop(0, (n_groups + STEP - 1) // STEP, body)


# --- host side -------------------------------------------------------------------------------------------------

def _words_view(w):
    """uint8 blocks [N, row_bytes] as int32 words (rows are whole words: blocks are)."""
    if isinstance(w, np.ndarray):
        return w if w.dtype == np.int32 else np.ascontiguousarray(w).view(np.int32)
    import torch

    return w if w.dtype == torch.int32 else w.contiguous().view(torch.int32)


def _step(bits: int, group: int) -> int:
    """Groups a step: about 32 q words a tile."""
    return max(1, 32 // _words(bits, group)[1])


def _check(w, bits: int, group: int, n: int, k: int) -> None:
    int_groups.check(bits, group)
    rb = k // group * int_groups.block_bytes(bits, group)
    if k % group or tuple(w.shape) != (n, rb // 4):
        raise ValueError(f"I{bits}_G{group} words {tuple(w.shape)} do not hold [{n}, {k}] (want [{n}, {rb // 4}])")


def int_group_gemv(x, w, bits: int, group: int, *, out=None, step: int | None = None, num_warps: int = 1,
                   target: str = "numpy"):
    """y [M, N] = x [M, K] @ W.T for intgroup blocks w (uint8 [N, row_bytes] or their int32 words); M <= 8. `step`
    (groups a loop step) and `num_warps` default to the untuned first choice (tools/bench_int_group_gemm
    --gemv-sweep times the others)."""
    w = _words_view(w)
    m, k = x.shape
    n = w.shape[0]
    _check(w, bits, group, n, k)
    if not 1 <= m <= MAX_ROWS or elem_stride(x, 1) != 1:
        raise ValueError(f"x [{m}, {k}] (rows contiguous) does not make a GEMV of 1-{MAX_ROWS} rows")
    out = empty(x, (m, n)) if out is None else out
    kern = compile(int_group_gemv_kernel, target, num_warps=num_warps, BITS=bits, GROUP=group, M=m,
                   STEP=step or _step(bits, group))
    kern[(n,)](w, x, out, n, k // group, elem_stride(w, 0), elem_stride(x, 0), elem_stride(out, 0))
    return out


def int_group_dequantize(w, bits: int, group: int, k: int, *, out=None, dtype: str = "float32",
                         target: str = "numpy"):
    """W [N, K] in out's dtype (`dtype`: "float32", "float16", "bfloat16") from intgroup blocks, columns in stored
    order."""
    w = _words_view(w)
    n = w.shape[0]
    _check(w, bits, group, n, k)
    if out is None:
        out = empty(w, (n, k), dtype)
    kern = compile(int_group_dequantize_kernel, target, num_warps=4, BITS=bits, GROUP=group, STEP=_step(bits, group))
    kern[(n,)](w, out, k // group, elem_stride(w, 0), elem_stride(out, 0))
    return out


def int_group_gemv_ref(x: np.ndarray, w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """x @ W.T in fp32 with W decoded by the numpy dequantizer of ir/formats/int_groups.py."""
    x = np.asarray(x, np.float32)
    w8 = np.ascontiguousarray(w).view(np.uint8)
    return x @ int_groups.dequantize(w8, (w8.shape[0], x.shape[-1]), bits, group).T
