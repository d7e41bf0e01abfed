"""RMS norm, and the fused residual add + RMS norm: DSL kernels, host launchers and numpy references.

One program normalizes one row held whole in one tile (BLOCK >= hidden size), in fp32. `OFFSET` multiplies by
(1 + w) instead of w (Gemma). The fused kernel writes the sum (rounded to its output dtype, which the norm then
reads, as an unfused add would) and the normed sum. With PDL (see dsl.use_pdl) a program loads its norm weight, then
waits for the kernel before.
"""

from __future__ import annotations

import numpy as np

from kernels_src.dsl import Plans, compile, elem_stride, signature, tl, use_pdl


def _weight(w, cols, mask, OFFSET):
    wv = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    return wv + 1.0 if OFFSET else wv


def _norm_row(xv, wv, n_cols, eps):
    ms = tl.sum(xv * xv, axis=0) / n_cols
    return xv * tl.rsqrt(ms + eps) * wv


def rms_norm_kernel(x, w, out, n_cols, x_stride, out_stride, eps, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
                    PDL: tl.constexpr = False):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    wv = _weight(w, cols, mask, OFFSET)  # a weight, no kernel's output: loaded before the wait
    if PDL:
        tl.wait_prior_grid()
        tl.launch_dependents()
    xv = tl.load(x + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * out_stride + cols, _norm_row(xv, wv, n_cols, eps), mask=mask)


def add_norm_row(x, residual, w, sum_out, row, n_cols, x_stride, r_stride, s_stride, eps, BLOCK, OFFSET, PDL):
    """Row `row` of add_rms_norm, shared by the kernels that also quantize it (x_int8, x_int8_groups): stores
    x + residual in sum_out's dtype and returns (its RMS norm in fp32, the columns, their mask)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    wv = _weight(w, cols, mask, OFFSET)
    if PDL:  # x and residual come from earlier kernels; sum_out and out may alias them
        tl.wait_prior_grid()
        tl.launch_dependents()
    xv = tl.load(x + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rv = tl.load(residual + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = (xv + rv).to(sum_out.dtype.element_ty)
    tl.store(sum_out + row * s_stride + cols, s, mask=mask)
    return _norm_row(s.to(tl.float32), wv, n_cols, eps), cols, mask


def add_rms_norm_kernel(x, residual, w, sum_out, out, n_cols, x_stride, r_stride, s_stride, out_stride, eps,
                        BLOCK: tl.constexpr, OFFSET: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    y, cols, mask = add_norm_row(x, residual, w, sum_out, row, n_cols, x_stride, r_stride, s_stride, eps, BLOCK,
                                 OFFSET, PDL)
    tl.store(out + row * out_stride + cols, y, mask=mask)


# --- host side -------------------------------------------------------------------------------------------------

def _empty_like(x):
    return np.empty_like(x) if isinstance(x, np.ndarray) else x.new_empty(x.shape)


# (kernel, the arrays' shapes, strides and dtypes, eps, offset, target, pdl) -> (launch on its grid, the integer and
# float arguments): a repeated launch of the same shapes (an eager step's norms) does no more than launch
_PLANS = Plans()


def _launch(kernel, arrays: tuple, eps: float, offset: bool, target: str, pdl: bool | None, fresh: int) -> tuple:
    """`kernel` over x = arrays[0] [rows, n] and the other arrays, each with its row stride (w has none); the last
    `fresh` were made here by _empty_like (their shapes, strides and dtype follow from x's). Returns (launch, its
    arguments): the same launch again for the same arrays."""
    key = None
    if type(arrays[0]) is not np.ndarray:
        key = (kernel, signature(*arrays[:len(arrays) - fresh]), fresh, eps, offset, target, pdl)
        if (plan := _PLANS.get(key)) is not None:
            args = (*arrays, *plan[1])
            plan[0](*args)
            return plan[0], args
    x, n = arrays[0], arrays[0].shape[-1]
    pdl = use_pdl(target, pdl)
    launch = compile(kernel, target, launch_pdl=pdl, BLOCK=tl.next_power_of_2(n), OFFSET=bool(offset),
                     PDL=pdl).bind(x.shape[0])
    w_at = 2 if kernel is add_rms_norm_kernel else 1
    ints = (n, *(elem_stride(a, 0) for i, a in enumerate(arrays) if i != w_at), float(eps))
    launch(*arrays, *ints)
    if key is not None:
        _PLANS.put(key, (launch, ints))
    return launch, (*arrays, *ints)


def rms_norm(x, w, eps: float, *, offset: bool = False, out=None, target: str = "numpy", pdl: bool | None = None):
    """x [rows, n] (rows may be strided, elements contiguous) -> out [rows, n] in out's dtype (x's by default)."""
    fresh = out is None
    out = _empty_like(x) if out is None else out
    _launch(rms_norm_kernel, (x, w, out), eps, offset, target, pdl, fresh)
    return out


def add_rms_norm(x, residual, w, eps: float, *, offset: bool = False, sum_out=None, out=None,
                 target: str = "numpy", pdl: bool | None = None):
    """(x + residual, rms_norm(x + residual)); the outputs may alias the inputs (each row is read, then written)."""
    return add_rms_norm_launched(x, residual, w, eps, offset=offset, sum_out=sum_out, out=out, target=target,
                                 pdl=pdl)[0]


def add_rms_norm_launched(x, residual, w, eps: float, *, offset: bool = False, sum_out=None, out=None,
                          target: str = "numpy", pdl: bool | None = None) -> tuple:
    """(add_rms_norm's (sum, norm), (launch, its arguments)): a caller passing the same arrays again (an eager step's
    kept buffers, backends/cuda/step_arena.py) may call launch(*arguments) for the same results."""
    fresh = 2 if sum_out is None and out is None else 0  # else every array keys the plan
    sum_out = _empty_like(x) if sum_out is None else sum_out
    out = _empty_like(x) if out is None else out
    again = _launch(add_rms_norm_kernel, (x, residual, w, sum_out, out), eps, offset, target, pdl, fresh)
    return (sum_out, out), again


# --- references ------------------------------------------------------------------------------------------------

def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float, offset: bool = False, out_dtype=None) -> np.ndarray:
    xf = x.astype(np.float32)
    wf = w.astype(np.float32) + (1.0 if offset else 0.0)
    ms = np.mean(xf * xf, axis=-1, keepdims=True)
    return (xf / np.sqrt(ms + np.float32(eps)) * wf).astype(out_dtype or x.dtype)


def add_rms_norm_ref(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float, offset: bool = False):
    s = (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
    return s, rms_norm_ref(s, w, eps, offset)
