"""add_rms_norm and gated_act that also write their output as the int8 GEMMs' and GEMVs' x (issue 13), so the
projection after them needs no x pass of its own. The codes are those of the output as stored (rounded to out's dtype
first), in either of two layouts:
- GROUP 32: int8 q [M, K] and fp32 d [M, K / 32], dequant_gemv_i8.quantize_x's (the int8 GEMV, 1-8 rows);
- GROUP 256: q [M, K], d [M, K / 256] and the sums of q per 32, fp32 [M, K / 32] or (SPLIT) fp16 [M, K / 16] pairs,
  gguf_mmq_sb.quantize_x256's (the MMQ's per256 variant, 4-32 rows).
K a multiple of GROUP (every GGUF K-quant's is of 256).
"""

from __future__ import annotations

from kernels_src.activations import gated_row
from kernels_src.dequant_gemv_i8 import _MAGIC
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.rms_norm import _empty_like, add_norm_row


def _store_q8(v, xq, xd, xs, row, first, n_cols, xq_stride, xd_stride, xs_stride, BLOCK, GROUP, SPLIT):
    """v [BLOCK] fp32 (inputs first .. first + BLOCK of the row) -> q and d per GROUP as quantize_x (32) or
    quantize_x256 (256, with the sums of q per 32 in xs) does."""
    g = tl.reshape(v, (BLOCK // GROUP, GROUP))
    amax = tl.max(tl.abs(g), axis=1, keep_dims=True)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = ((g * inv + _MAGIC).to(tl.uint32, bitcast=True) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True)
    cols = first + tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(xq + row * xq_stride + cols, q, mask=cols < n_cols)
    blk = first // GROUP + tl.arange(0, BLOCK // GROUP)[:, None]
    tl.store(xd + row * xd_stride + blk, amax * (1.0 / 127.0), mask=blk < n_cols // GROUP)
    if GROUP == 256:  # sum(q) per 32, as quantize_x256_kernel's dot4 over the words
        sums = tl.sum(tl.reshape(q.to(tl.int32), (BLOCK // 32, 32)), axis=1, keep_dims=True)  # [BLOCK / 32, 1]
        b32 = first // 32 + tl.arange(0, BLOCK // 32)[:, None]
        if SPLIT:  # (64 floor(sum / 64), sum mod 64), each exact in fp16
            low, half = sums & 63, tl.arange(0, 2)[None, :]
            tl.store(xs + row * xs_stride + 2 * b32 + half, tl.where(half == 0, sums - low, low).to(tl.float16),
                     mask=(b32 < n_cols // 32) & (half < 2))
        else:
            tl.store(xs + row * xs_stride + b32, sums.to(tl.float32), mask=b32 < n_cols // 32)


def stored_norm_row(x, residual, w, sum_out, out, row, n_cols, x_stride, r_stride, s_stride, out_stride, eps, BLOCK,
                    OFFSET, PDL):
    """add_rms_norm's row, stored in out's dtype; returned as stored, in fp32 (0 past the row): what is quantized."""
    y, cols, mask = add_norm_row(x, residual, w, sum_out, row, n_cols, x_stride, r_stride, s_stride, eps, BLOCK,
                                 OFFSET, PDL)
    y = y.to(out.dtype.element_ty)  # the codes are the stored output's
    tl.store(out + row * out_stride + cols, y, mask=mask)
    return tl.where(mask, y.to(tl.float32), 0.0)


def stored_gated_row(gate, up, out, row, first, n_cols, gate_stride, up_stride, out_stride, BLOCK, ACT, PDL):
    """The gated activation's inputs first .. first + BLOCK of a row, stored and returned as stored_norm_row's."""
    y, cols, mask = gated_row(gate, up, row, first, n_cols, gate_stride, up_stride, BLOCK, ACT, PDL)
    y = y.to(out.dtype.element_ty)
    tl.store(out + row * out_stride + cols, y, mask=mask)
    return tl.where(mask, y.to(tl.float32), 0.0)


def add_rms_norm_q8_kernel(x, residual, w, sum_out, out, xq, xd, xs, n_cols, x_stride, r_stride, s_stride,
                           out_stride, xq_stride, xd_stride, xs_stride, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
                           GROUP: tl.constexpr = 32, SPLIT: tl.constexpr = False, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    v = stored_norm_row(x, residual, w, sum_out, out, row, n_cols, x_stride, r_stride, s_stride, out_stride, eps,
                        BLOCK, OFFSET, PDL)
    _store_q8(v, xq, xd, xs, row, 0, n_cols, xq_stride, xd_stride, xs_stride, BLOCK, GROUP, SPLIT)


def gated_act_q8_kernel(gate, up, out, xq, xd, xs, n_cols, gate_stride, up_stride, out_stride, xq_stride, xd_stride,
                        xs_stride, BLOCK: tl.constexpr, ACT: tl.constexpr, GROUP: tl.constexpr = 32,
                        SPLIT: tl.constexpr = False, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    first = tl.program_id(1) * BLOCK
    v = stored_gated_row(gate, up, out, row, first, n_cols, gate_stride, up_stride, out_stride, BLOCK, ACT, PDL)
    _store_q8(v, xq, xd, xs, row, first, n_cols, xq_stride, xd_stride, xs_stride, BLOCK, GROUP, SPLIT)


# --- host side -------------------------------------------------------------------------------------------------

def _q8_bufs(x, group: int, split: bool, xq=None, xd=None):
    """(xq, xd, xs) for x [M, K]: xs (group 256's sums) is xd for group 32, where the kernels do not read it."""
    from kernels_src.dsl import empty

    m, k = x.shape
    if group not in (32, 256):
        raise ValueError(f"int8 x per {group}: 32 (the GEMV's) or 256 (the MMQ's per256)")
    if k % group:
        raise ValueError(f"int8 x: {k} inputs are not a multiple of {group}")
    xq = empty(x, (m, k), "int8") if xq is None else xq
    xd = empty(x, (m, k // group), "float32") if xd is None else xd
    if group == 32:
        return xq, xd, xd
    return xq, xd, empty(x, (m, k // 16), "float16") if split else empty(x, (m, k // 32), "float32")


def add_rms_norm_q8(x, residual, w, eps: float, *, offset: bool = False, sum_out=None, out=None, xq=None, xd=None,
                    group: int = 32, split: bool = False, target: str = "numpy", pdl: bool | None = None):
    """rms_norm.add_rms_norm, plus x's int8 form of its output: (sum, out, xq, xd) as quantize_x gives them (group
    32), or (sum, out, (xq, xd, xs)) as quantize_x256(.., split) does (group 256)."""
    sum_out = _empty_like(x) if sum_out is None else sum_out
    out = _empty_like(x) if out is None else out
    bufs = _q8_bufs(x, group, split, xq, xd)
    n = x.shape[-1]
    pdl = use_pdl(target, pdl)
    k = compile(add_rms_norm_q8_kernel, target, launch_pdl=pdl, BLOCK=max(group, tl.next_power_of_2(n)),
                OFFSET=bool(offset), GROUP=group, SPLIT=bool(split), PDL=pdl)
    k[x.shape[0]](x, residual, w, sum_out, out, *bufs, n, elem_stride(x, 0), elem_stride(residual, 0),
                  elem_stride(sum_out, 0), elem_stride(out, 0), *(elem_stride(b, 0) for b in bufs), float(eps))
    return (sum_out, out, *bufs[:2]) if group == 32 else (sum_out, out, bufs)


def gated_act_q8(gate, up, act: str = "silu", *, out=None, xq=None, xd=None, block: int = 1024, group: int = 32,
                 split: bool = False, target: str = "numpy", pdl: bool | None = None):
    """activations.gated_act, plus x's int8 form of its output: (out, xq, xd) (group 32) or (out, (xq, xd, xs))
    (group 256), as add_rms_norm_q8; programs of `block` inputs (a multiple of the group)."""
    out = _empty_like(gate) if out is None else out
    bufs = _q8_bufs(gate, group, split, xq, xd)
    n = gate.shape[1]
    block = max(group, min(block, tl.next_power_of_2(n)))
    if block % group:
        raise ValueError(f"gated_act_q8: programs of {block} inputs are not whole groups of {group}")
    pdl = use_pdl(target, pdl)
    k = compile(gated_act_q8_kernel, target, launch_pdl=pdl, BLOCK=block, ACT=act, GROUP=group, SPLIT=bool(split),
                PDL=pdl)
    k[gate.shape[0], tl.cdiv(n, block)](gate, up, out, *bufs, n, elem_stride(gate, 0), elem_stride(up, 0),
                                         elem_stride(out, 0), *(elem_stride(b, 0) for b in bufs))
    return (out, *bufs[:2]) if group == 32 else (out, bufs)
