"""GEMV y[M, N] = x[M, K] @ W.T (M <= 8) straight from integer-group blocks (GPTQ, AWQ, compressed-tensors weights
in the intgroup layout of ir/formats/int_groups.py), and the dequantization of such rows for a cuBLAS GEMM at larger
batches: DSL kernels, launchers, numpy references.

W arrives as int32 words [N, row_words]: each group of GROUP inputs is one block of 2 + GROUP * BITS / 32 words,
[scale f32][bias f32][q words], input j of the group at bits BITS * (j % PER) of q word j // PER (PER = 32 / BITS).
A block decodes as q * scale + bias, so a group contributes scale * sum(q x) + bias * sum(x).

The GEMV streams W once and is bound by its bytes; it follows the GGUF GEMV's design (kernels_src/dequant_gemv.py):
- A row is walked as a flat run of VEC-word vectors (VEC = 4: 16-byte loads; 2 where rows are not whole 16-byte
  vectors: an odd number of groups, or one group a row). Blocks are 2 mod 4 words long, so a vector holds either
  q words only or a block's 2-word header and 2 q words of one block: every q word of a vector is in the same block
  g = (first word) // block words, whose scale and bias the lane loads as one 8-byte word (lanes of one block read
  the same address). Header words meet x = 0 (x is loaded under a mask), so they add nothing.
- A program (one warp by default) takes ROWS rows, unrolled, and LANES vectors of each a step; each step issues
  every row's W loads (and under PDL waits for x only then), then x once for all rows: x stays in registers.
- W is read as 16-bit halves: half i of a block's q holds inputs EPH i .. EPH i + EPH - 1 (EPH = 16 / BITS), which
  meet x word i (EPH 16-bit values: one 64-bit word at 4 bits, 32-bit at 8), so W's and x's tiles have the same
  shape and layout. A field is masked in place and read as a float (gguf_gemv_common._Decode: one LOP3 and one FMA a
  weight on Triton); x is pre-scaled once a step for each field's place and reused by every row.
- Bias and scale apply once per lane, row and step (scale * sum(q x) + bias * sum(x)), sums in fp32.
More rows take the tensor-core GEMM of int_group_gemm.py.
"""

from __future__ import annotations

import numpy as np

from ir.formats import int_groups
from kernels_src.dequant_gemv import SUBNORMAL_TARGETS, _addr, aligned_x
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.gguf_gemv_common import _add, _Decode, _dot, _x_vals

MAX_ROWS = 8


def _words(bits: int, group: int) -> tuple[int, int, int]:
    """(q words a block, WPB: those rounded up to a power of two, words a block)."""
    qw = group * bits // 32
    return qw, tl.next_power_of_2(qw), 2 + qw


def _tiles(STEP: int, BITS: int, GROUP: int):
    """(group offsets [STEP, 1], word offsets [1, WPB]) of a dequantization step's tile."""
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


def _lane_vectors(it, lane, half, n_vec, LANES: int, HV: int, BITS: int, GROUP: int):
    """Step `it`'s vectors of HV halves, one a lane: (first half of each in its row [LANES, 1], its block
    [LANES, 1], the x word of each half [LANES, HV], whether that half is a q half of a vector inside the row)."""
    QW, _, BW = _words(BITS, GROUP)
    v = it * LANES + lane
    h0 = tl.minimum(v, n_vec - 1) * HV  # past the row's end: the last vector again, its x masked to 0
    g = h0 // (2 * BW)
    qi = h0 - g * (2 * BW) - 4 + half  # q half index in block g (the header's 4 halves come first)
    return h0, g, g * (GROUP * BITS // 16) + qi, (v < n_vec) & (qi >= 0) & (qi < 2 * QW)


def _program_rows(w, w_stride, n_rows, ROWS: int):
    """(the program's rows, their words, their blocks' headers as 8-byte words): spare rows re-read the last."""
    rows = [tl.program_id(0) * ROWS + r for r in range(ROWS)]
    clamped = [tl.minimum(row, n_rows - 1).to(tl.int64) for row in rows]
    return (rows, [w + r * w_stride for r in clamped],
            [w.to(tl.pointer_type(tl.uint64)) + r * (w_stride // 2) for r in clamped])


def _scale_bias(head):
    """A block's header word as (scale, bias) f32."""
    return head.to(tl.uint32).to(tl.float32, bitcast=True), (head >> 32).to(tl.uint32).to(tl.float32, bitcast=True)


def _store_rows(y, y_stride, rows, n_rows, accs, M: int, unit: float = 1.0, PDL: bool = False):
    """y[m, row] = unit * the sum of row's accumulator for m; under PDL after a wait (and launch_dependents)."""
    if PDL:  # a program whose loop ran no step must wait too (a later wait returns at once)
        tl.wait_prior_grid()
        tl.launch_dependents()
    for r, row in enumerate(rows):
        for m in range(M):
            tl.store(y + m * y_stride + row, tl.sum(accs[r * M + m]) * unit, mask=row < n_rows)


def int_group_gemv_kernel(w, x, y, n_rows, n_groups, w_stride, x_stride, y_stride, BITS: tl.constexpr,
                          GROUP: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                          VEC: tl.constexpr, SUBNORMAL: tl.constexpr, PDL: tl.constexpr = False):
    """w_stride in words, even (and a multiple of VEC); a row's n_groups blocks are whole VEC-word vectors."""
    EPH, HV, BW = 16 // BITS, 2 * VEC, _words(BITS, GROUP)[2]  # inputs a half, halves a vector, words a block
    dec = _Decode(SUBNORMAL)
    rows, w32, w64 = _program_rows(w, w_stride, n_rows, ROWS)
    w16 = [p.to(tl.pointer_type(tl.uint16)) for p in w32]
    lane, half = tl.arange(0, LANES)[:, None], tl.arange(0, HV)[None, :]
    n_vec = n_groups * (2 * BW) // HV
    field = [BITS * k for k in range(EPH)]  # field k of a half: input EPH i + k, at bits BITS k

    def body(it, *accs):
        h0, g, xw, xmask = _lane_vectors(it, lane, half, n_vec, LANES, HV, BITS, GROUP)
        raw = [tl.load(p + h0 + half).to(tl.uint32) for p in w16]  # every row's W, then its headers
        heads = [_scale_bias(tl.load(p + g * (BW // 2))) for p in w64]
        if PDL:
            tl.wait_prior_grid()
        out = list(accs)
        for m in range(M):
            xs = _x_vals(x + m * x_stride, xw, EPH, xmask)
            xsum = tl.sum(_add(xs), axis=-1, keep_dims=True) * (1.0 / dec.unit)
            xq = [dec.x(v, f) for v, f in zip(xs, field, strict=True)]
            for r, (scale, bias) in enumerate(heads):
                qdot = _dot([dec.q(raw[r], f, BITS) for f in field], xq)
                out[r * M + m] = out[r * M + m] + scale * qdot + bias * xsum
        return tuple(out)

    init = tuple(tl.zeros((LANES, 1), tl.float32) for _ in range(ROWS * M))
    accs = tl.fori_loop(0, (n_vec + LANES - 1) // LANES, body, init)
    _store_rows(y, y_stride, rows, n_rows, accs, M, dec.unit, PDL)


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


# (bits, group, M, N, K) -> the int8 path's tiles measured best on a GPU by tools/bench_int_group_gemm --gemv-sweep
# (its last lines print this literal): ROWS, LANES, num_warps and the loop's form (prefetch, stages: gemv_loop.py).
# A problem not listed takes default_tiles.
TUNED: dict[tuple[int, int, int, int, int], dict] = {}


def default_tiles(m: int, n: int) -> dict:
    """ROWS, LANES (vectors a row and step) and num_warps, from the H200 sweep of the int8-x path (tools/
    bench_int_group_gemm --gemv-sweep --quick, 2026-12-03; 4-bit groups of 128): one-warp programs; 4 rows a program
    at 1 batch row where that still leaves over 2048 programs (28672 x 4096: 21.2 us, 73% of copy), else 2 (4096 x
    14336: 13.2 us against 15.7 at 4); 4 rows at 2-4 batch rows (1.6-2.4x one row's time), 2 past that; two
    vectors a lane where the grid has at most 2048 programs (about 16 warps an SM), so more bytes are in flight."""
    if n < 1024:
        rows = 1
    elif m == 1:
        rows = 4 if n // 4 > 2048 else 2
    else:
        rows = 4 if m <= 4 else 2
    return dict(ROWS=rows, LANES=64 if n // rows <= 2048 else 32, num_warps=1)


def _vec(w, n_groups: int) -> int:
    """Words a vector: 4 where every row is whole 16-byte vectors from a 16-byte aligned start, else 2."""
    return 4 if n_groups % 2 == 0 and elem_stride(w, 0) % 4 == 0 and _addr(w) % 16 == 0 else 2


def int_group_gemv(x, w, bits: int, group: int, *, out=None, rows: int | None = None, lanes: int | None = None,
                   num_warps: int | None = None, target: str = "numpy", pdl: bool | None = None,
                   int8_x: bool | None = None, prefetch: bool | None = None, stages: int | None = None,
                   x_i8: tuple | None = None):
    """y [M, N] = x [M, K] @ W.T for intgroup blocks w (uint8 [N, row_bytes] or their int32 words); M <= 8. rows,
    lanes (a power of two) and num_warps default to default_tiles (tools/bench_int_group_gemm --gemv-sweep times
    others); pdl (default: dsl.use_pdl) makes the GEMV a programmatic dependent launch.

    int8_x (default: int_group_gemv_i8.uses_int8, the Triton target): x quantized to int8 per q word's inputs first,
    then dp4a (kernels_src/int_group_gemv_i8.py); y then differs from the fp32 path by that quantization (within
    int_group_gemv_i8.int8_error_bound). prefetch, stages (int8 path; default: TUNED's, else gemv_loop's defaults):
    the K loop's form (kernels_src/gemv_loop.py). x_i8: x already quantized as quantize_x_i8 does (kernels_src/
    x_int8_groups), used where the int8 path runs, ignored on the fp32 path."""
    from kernels_src.gemv_loop import loop_form
    from kernels_src.int_group_gemv_i8 import gemv_i8, uses_int8  # the int8 path builds on this module

    w = _words_view(w)
    m, k = x.shape
    n = w.shape[0]
    _check(w, bits, group, n, k)
    if not 1 <= m <= MAX_ROWS or elem_stride(x, 1) != 1:
        raise ValueError(f"x [{m}, {k}] (rows contiguous) does not make a GEMV of 1-{MAX_ROWS} rows")
    cfg = dict(TUNED.get((bits, group, m, n, k)) or default_tiles(m, n))
    form = {key: cfg.pop(key) for key in ("prefetch", "stages") if key in cfg}
    cfg.update({key: v for key, v in (("ROWS", rows), ("LANES", lanes), ("num_warps", num_warps)) if v is not None})
    if cfg["LANES"] < 1 or cfg["LANES"] & (cfg["LANES"] - 1) or not 1 <= cfg["ROWS"] <= 16:
        raise ValueError(f"tiles {cfg}: LANES is a power of two, ROWS 1-16")
    if _addr(w) % 8 or elem_stride(w, 0) % 2 or elem_stride(w, 1) != 1:  # headers are read as 8-byte words
        w = w.contiguous().clone() if hasattr(w, "clone") else np.array(w, order="C", copy=True)
    x = aligned_x(x)
    out = empty(x, (m, n)) if out is None else out
    nw = cfg.pop("num_warps")
    vec = _vec(w, k // group)
    if uses_int8(target, int8_x):
        gemv_i8(x, w, out, bits, group, vec, cfg, nw, target, pdl, *loop_form(form, prefetch, stages), x_i8)
        return out
    if prefetch or stages:
        raise ValueError("prefetch, stages: only the int8-activation path's loop takes them")
    pdl = use_pdl(target, pdl)
    kern = compile(int_group_gemv_kernel, target, num_warps=nw, launch_pdl=pdl, BITS=bits, GROUP=group, M=m,
                   VEC=vec, SUBNORMAL=target in SUBNORMAL_TARGETS, PDL=pdl, **cfg)
    kern[(tl.cdiv(n, cfg["ROWS"]),)](w, x, out, n, k // group, elem_stride(w, 0), elem_stride(x, 0),
                                     elem_stride(out, 0))
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
