"""add_rms_norm and gated_act that also write their output as the int8 GEMV's x (issue 13): int8 q [M, K] and fp32
d [M, K / 32], the layout and rounding of dequant_gemv_i8.quantize_x on the output as stored (rounded to out's
dtype first), so the GEMV after them needs no quantize_x launch. K a multiple of 32 (every GGUF K-quant's is).
"""

from __future__ import annotations

from kernels_src.activations import gated_row
from kernels_src.dequant_gemv_i8 import _MAGIC
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.rms_norm import _empty_like, add_norm_row


def _store_q8(v, xq, xd, row, first, n_cols, xq_stride, xd_stride, BLOCK):
    """v [BLOCK] fp32 (inputs first .. first + BLOCK of the row) -> q and d per 32, as quantize_x_kernel."""
    g = tl.reshape(v, (BLOCK // 32, 32))
    amax = tl.max(tl.abs(g), axis=1, keep_dims=True)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = ((g * inv + _MAGIC).to(tl.uint32, bitcast=True) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True)
    cols = first + tl.arange(0, BLOCK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(xq + row * xq_stride + cols, q, mask=cols < n_cols)
    blk = first // 32 + tl.arange(0, BLOCK // 32)[:, None]
    tl.store(xd + row * xd_stride + blk, amax * (1.0 / 127.0), mask=blk < n_cols // 32)


def add_rms_norm_q8_kernel(x, residual, w, sum_out, out, xq, xd, n_cols, x_stride, r_stride, s_stride, out_stride,
                           xq_stride, xd_stride, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
                           PDL: tl.constexpr = False):
    row = tl.program_id(0)
    y, cols, mask = add_norm_row(x, residual, w, sum_out, row, n_cols, x_stride, r_stride, s_stride, eps, BLOCK,
                                 OFFSET, PDL)
    y = y.to(out.dtype.element_ty)  # the codes are the stored output's
    tl.store(out + row * out_stride + cols, y, mask=mask)
    _store_q8(tl.where(mask, y.to(tl.float32), 0.0), xq, xd, row, 0, n_cols, xq_stride, xd_stride, BLOCK)


def gated_act_q8_kernel(gate, up, out, xq, xd, n_cols, gate_stride, up_stride, out_stride, xq_stride, xd_stride,
                        BLOCK: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    first = tl.program_id(1) * BLOCK
    y, cols, mask = gated_row(gate, up, row, first, n_cols, gate_stride, up_stride, BLOCK, ACT, PDL)
    y = y.to(out.dtype.element_ty)
    tl.store(out + row * out_stride + cols, y, mask=mask)
    _store_q8(tl.where(mask, y.to(tl.float32), 0.0), xq, xd, row, first, n_cols, xq_stride, xd_stride, BLOCK)


# --- host side -------------------------------------------------------------------------------------------------

def _q8_bufs(x, xq, xd):
    from kernels_src.dsl import empty

    m, k = x.shape
    if k % 32:
        raise ValueError(f"int8 x: {k} inputs are not a multiple of 32")
    return (empty(x, (m, k), "int8") if xq is None else xq,
            empty(x, (m, k // 32), "float32") if xd is None else xd)


def add_rms_norm_q8(x, residual, w, eps: float, *, offset: bool = False, sum_out=None, out=None, xq=None, xd=None,
                    target: str = "numpy", pdl: bool | None = None):
    """rms_norm.add_rms_norm, plus quantize_x of its output: (sum, out, xq, xd)."""
    sum_out = _empty_like(x) if sum_out is None else sum_out
    out = _empty_like(x) if out is None else out
    xq, xd = _q8_bufs(x, xq, xd)
    n = x.shape[-1]
    pdl = use_pdl(target, pdl)
    k = compile(add_rms_norm_q8_kernel, target, launch_pdl=pdl, BLOCK=max(32, tl.next_power_of_2(n)),
                OFFSET=bool(offset), PDL=pdl)
    k[x.shape[0]](x, residual, w, sum_out, out, xq, xd, n, elem_stride(x, 0), elem_stride(residual, 0),
                  elem_stride(sum_out, 0), elem_stride(out, 0), elem_stride(xq, 0), elem_stride(xd, 0), float(eps))
    return sum_out, out, xq, xd


def gated_act_q8(gate, up, act: str = "silu", *, out=None, xq=None, xd=None, block: int = 1024,
                 target: str = "numpy", pdl: bool | None = None):
    """activations.gated_act, plus quantize_x of its output: (out, xq, xd)."""
    out = _empty_like(gate) if out is None else out
    xq, xd = _q8_bufs(gate, xq, xd)
    n = gate.shape[1]
    block = max(32, min(block, tl.next_power_of_2(n)))
    pdl = use_pdl(target, pdl)
    k = compile(gated_act_q8_kernel, target, launch_pdl=pdl, BLOCK=block, ACT=act, PDL=pdl)
    k[gate.shape[0], tl.cdiv(n, block)](gate, up, out, xq, xd, n, elem_stride(gate, 0), elem_stride(up, 0),
                                         elem_stride(out, 0), elem_stride(xq, 0), elem_stride(xd, 0))
    return out, xq, xd
