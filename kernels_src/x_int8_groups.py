"""add_rms_norm and gated_act that also write their output as the integer-group GEMV's or GEMM's int8 x (GPTQ / AWQ;
kernels_src/int_group_gemv_i8's quantize_x_i8 layout: per q word's inputs, int8 words, d, sums and z0 sum(x - q d),
each at its q word's place in a row of blocks). That layout's chunks (8 inputs at 4 bits, in two planes) and sums do
not follow the norm's register tile, so each program stores its output, waits at a barrier (its threads' writes are
then visible to all of them) and runs quantize_x_i8's own chunk code over what it wrote: the same arrays, bit for
bit, without a launch of their own. K a multiple of the group.

The `_mmq` kernels write the integer-group GEMM's (kernels_src/int_group_mmq, 9-128 rows) instead: quantize_x_mmq's
int8 xq (per step of S inputs, at 4 bits each step's even inputs first) and D, P, Q per (step, row) in xs [K / S, 3,
M padded]. That layout follows the register tile (a step's inputs are the tile's contiguous ones), so these store
straight from it.
"""

from __future__ import annotations

from kernels_src.activations import gated_row
from kernels_src.dequant_gemv_i8 import _MAGIC
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.int_group_gemv import _words
from kernels_src.int_group_gemv_i8 import _planes, _quantize_chunks
from kernels_src.int_group_mmq import BASE, PAD_ROWS, _halves
from kernels_src.rms_norm import _empty_like, add_norm_row
from kernels_src.x_int8 import stored_gated_row, stored_norm_row


def _requantize(out_row, xq, xd, xs, xr, row, first, n_cols, xq_stride, xd_stride, BLOCK: int, BITS: int,
                GROUP: int):
    """quantize_x_i8 of this program's inputs first .. first + BLOCK (a multiple of a chunk) of out's row."""
    tl.debug_barrier()  # out's row as every thread of the program wrote it
    epw, chunks = 32 // BITS, BLOCK * BITS // 32
    tile = min(chunks, 128)
    for i in range(chunks // tile):
        c = first // epw + i * tile + tl.arange(0, tile)  # those past the row (BLOCK's padding): skipped
        _quantize_chunks(out_row, xq.to(tl.pointer_type(tl.uint32)) + row * (xq_stride // 4), xd + row * xd_stride,
                         xs + row * xd_stride, xr + row * xd_stride, c, n_cols // GROUP, BITS, GROUP)


def add_rms_norm_i8g_kernel(x, residual, w, sum_out, out, xq, xd, xs, xr, n_cols, x_stride, r_stride, s_stride,
                            out_stride, xq_stride, xd_stride, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
                            BITS: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    y, cols, mask = add_norm_row(x, residual, w, sum_out, row, n_cols, x_stride, r_stride, s_stride, eps, BLOCK,
                                 OFFSET, PDL)
    tl.store(out + row * out_stride + cols, y, mask=mask)
    _requantize(out + row * out_stride, xq, xd, xs, xr, row, 0, n_cols, xq_stride, xd_stride, BLOCK, BITS, GROUP)


def gated_act_i8g_kernel(gate, up, out, xq, xd, xs, xr, n_cols, gate_stride, up_stride, out_stride, xq_stride,
                         xd_stride, BLOCK: tl.constexpr, ACT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                         PDL: tl.constexpr = False):
    row = tl.program_id(0)
    first = tl.program_id(1) * BLOCK
    y, cols, mask = gated_row(gate, up, row, first, n_cols, gate_stride, up_stride, BLOCK, ACT, PDL)
    tl.store(out + row * out_stride + cols, y, mask=mask)
    _requantize(out + row * out_stride, xq, xd, xs, xr, row, first, n_cols, xq_stride, xd_stride, BLOCK, BITS, GROUP)


def _store_mmq(v, xq, xs, row, first, n_cols, xq_stride, xs_stride, xs_plane, BLOCK: int, BITS: int, STEP: int):
    """quantize_x_mmq_kernel's codes and D, P, Q of v [BLOCK] fp32 (inputs first .. first + BLOCK of the row)."""
    H = _halves(BITS)
    g = tl.reshape(v, (BLOCK // STEP, STEP // H, H))  # g[s, j, part]: input H j + part of step s
    s = first // STEP + tl.arange(0, BLOCK // STEP)[:, None, None]
    part, j = tl.arange(0, H)[None, None, :], tl.arange(0, STEP // H)[None, :, None]
    amax = tl.max(tl.max(tl.abs(g), axis=2, keep_dims=True), axis=1, keep_dims=True)  # [S, 1, 1]
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = (g * inv + _MAGIC).to(tl.int32, bitcast=True) - BASE
    ok = s < n_cols // STEP
    tl.store(xq + row * xq_stride + s * STEP + part * (STEP // H) + j, q.to(tl.int8), mask=ok & (j >= 0) & (part >= 0))
    sx = amax * (1.0 / 127.0)
    total = tl.sum(tl.sum(q, axis=2, keep_dims=True), axis=1, keep_dims=True).to(tl.float32)
    if BITS == 4:
        odd = tl.sum(tl.sum(tl.where(part == 1, q, 0), axis=2, keep_dims=True), axis=1, keep_dims=True)
        d, p = sx * 0.0625, sx * (8.0 * odd.to(tl.float32))
    else:
        d, p = sx, sx * (128.0 * total)
    at = xs + s * xs_stride + row
    tl.store(at, d, mask=ok)
    tl.store(at + xs_plane, p, mask=ok)
    tl.store(at + 2 * xs_plane, sx * total, mask=ok)


def add_rms_norm_mmq_kernel(x, residual, w, sum_out, out, xq, xs, n_cols, x_stride, r_stride, s_stride, out_stride,
                            xq_stride, xs_stride, xs_plane, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
                            BITS: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    v = stored_norm_row(x, residual, w, sum_out, out, row, n_cols, x_stride, r_stride, s_stride, out_stride, eps,
                        BLOCK, OFFSET, PDL)
    _store_mmq(v, xq, xs, row, 0, n_cols, xq_stride, xs_stride, xs_plane, BLOCK, BITS, STEP)


def gated_act_mmq_kernel(gate, up, out, xq, xs, n_cols, gate_stride, up_stride, out_stride, xq_stride, xs_stride,
                         xs_plane, BLOCK: tl.constexpr, ACT: tl.constexpr, BITS: tl.constexpr, STEP: tl.constexpr,
                         PDL: tl.constexpr = False):
    row = tl.program_id(0)
    first = tl.program_id(1) * BLOCK
    v = stored_gated_row(gate, up, out, row, first, n_cols, gate_stride, up_stride, out_stride, BLOCK, ACT, PDL)
    _store_mmq(v, xq, xs, row, first, n_cols, xq_stride, xs_stride, xs_plane, BLOCK, BITS, STEP)


# --- host side -------------------------------------------------------------------------------------------------

def _i8_bufs(x, bits: int, group: int):
    from kernels_src.dsl import empty

    m, k = x.shape
    if k % group:
        raise ValueError(f"int8 x: {k} inputs are not a multiple of the group ({group})")
    rw = k // group * _words(bits, group)[2]
    return (empty(x, (m, _planes(bits) * rw * 4), "int8"), *(empty(x, (m, rw), "float32") for _ in range(3)))


def add_rms_norm_i8g(x, residual, w, eps: float, bits: int, group: int, *, offset: bool = False,
                     target: str = "numpy", pdl: bool | None = None):
    """rms_norm.add_rms_norm, plus quantize_x_i8 of its output: (sum, out, (xq, xd, xs, xr))."""
    sum_out, out = _empty_like(x), _empty_like(x)
    arrays = _i8_bufs(x, bits, group)
    n = x.shape[-1]
    pdl = use_pdl(target, pdl)
    k = compile(add_rms_norm_i8g_kernel, target, launch_pdl=pdl, BLOCK=max(32, tl.next_power_of_2(n)),
                OFFSET=bool(offset), BITS=bits, GROUP=group, PDL=pdl)
    k[x.shape[0]](x, residual, w, sum_out, out, *arrays, n, elem_stride(x, 0), elem_stride(residual, 0),
                  elem_stride(sum_out, 0), elem_stride(out, 0), elem_stride(arrays[0], 0), elem_stride(arrays[1], 0),
                  float(eps))
    return sum_out, out, arrays


def gated_act_i8g(gate, up, act: str, bits: int, group: int, *, block: int = 1024, target: str = "numpy",
                  pdl: bool | None = None):
    """activations.gated_act, plus quantize_x_i8 of its output: (out, (xq, xd, xs, xr))."""
    out = _empty_like(gate)
    arrays = _i8_bufs(gate, bits, group)
    n = gate.shape[1]
    block = max(32, min(block, tl.next_power_of_2(n)))
    pdl = use_pdl(target, pdl)
    k = compile(gated_act_i8g_kernel, target, launch_pdl=pdl, BLOCK=block, ACT=act, BITS=bits, GROUP=group, PDL=pdl)
    k[gate.shape[0], tl.cdiv(n, block)](gate, up, out, *arrays, n, elem_stride(gate, 0), elem_stride(up, 0),
                                         elem_stride(out, 0), elem_stride(arrays[0], 0), elem_stride(arrays[1], 0))
    return out, arrays


def _mmq_bufs(x, step: int):
    from kernels_src.dsl import empty

    m, k = x.shape
    if k % step:
        raise ValueError(f"int8 x: {k} inputs are not a multiple of the GEMM's step ({step})")
    return empty(x, (m, k), "int8"), empty(x, (k // step, 3, -(-m // PAD_ROWS) * PAD_ROWS), "float32")


def add_rms_norm_mmq(x, residual, w, eps: float, bits: int, step: int, *, offset: bool = False,
                     target: str = "numpy", pdl: bool | None = None):
    """rms_norm.add_rms_norm, plus quantize_x_mmq of its output (steps of `step` inputs: int_group_mmq.mmq_step's):
    (sum, out, (xq, xs))."""
    sum_out, out = _empty_like(x), _empty_like(x)
    xq, xs = _mmq_bufs(x, step)
    n = x.shape[-1]
    pdl = use_pdl(target, pdl)
    k = compile(add_rms_norm_mmq_kernel, target, launch_pdl=pdl, BLOCK=max(step, tl.next_power_of_2(n)),
                OFFSET=bool(offset), BITS=bits, STEP=step, PDL=pdl)
    k[x.shape[0]](x, residual, w, sum_out, out, xq, xs, n, elem_stride(x, 0), elem_stride(residual, 0),
                  elem_stride(sum_out, 0), elem_stride(out, 0), elem_stride(xq, 0), elem_stride(xs, 0),
                  elem_stride(xs, 1), float(eps))
    return sum_out, out, (xq, xs)


def gated_act_mmq(gate, up, act: str, bits: int, step: int, *, block: int = 1024, target: str = "numpy",
                  pdl: bool | None = None):
    """activations.gated_act, plus quantize_x_mmq of its output: (out, (xq, xs)); programs of `block` inputs (whole
    steps)."""
    out = _empty_like(gate)
    xq, xs = _mmq_bufs(gate, step)
    n = gate.shape[1]
    block = max(step, min(block, tl.next_power_of_2(n)))
    if block % step:
        raise ValueError(f"gated_act_mmq: programs of {block} inputs are not whole steps of {step}")
    pdl = use_pdl(target, pdl)
    k = compile(gated_act_mmq_kernel, target, launch_pdl=pdl, BLOCK=block, ACT=act, BITS=bits, STEP=step, PDL=pdl)
    k[gate.shape[0], tl.cdiv(n, block)](gate, up, out, xq, xs, n, elem_stride(gate, 0), elem_stride(up, 0),
                                         elem_stride(out, 0), elem_stride(xq, 0), elem_stride(xs, 0),
                                         elem_stride(xs, 1))
    return out, (xq, xs)
