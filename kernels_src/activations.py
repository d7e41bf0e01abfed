"""Gated activations act(gate) * up (SiLU, GELU exact and tanh forms): DSL kernel, host launcher, reference.

gate and up are two row-strided inputs, so the fused gate_up projection [T, 2I] passes as its two halves
(views, no copy). Math in fp32; the output takes out's dtype.
"""

from __future__ import annotations

import math

import numpy as np

from kernels_src.dsl import Plans, compile, elem_stride, signature, tl, use_pdl

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _act(x, ACT):
    if ACT == "silu":
        return x / (1.0 + tl.exp(-x))
    if ACT == "gelu":
        return 0.5 * x * (1.0 + tl.erf(x * (1.0 / math.sqrt(2.0))))
    if ACT == "gelu_tanh":
        return 0.5 * x * (1.0 + tl.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    raise ValueError(f"unknown activation {ACT!r} (known: {', '.join(ACTIVATIONS)})")


def gated_row(gate, up, row, first, n_cols, gate_stride, up_stride, BLOCK, ACT, PDL):
    """act(gate) * up for columns first.. of row `row` in fp32, with the columns and their mask; shared by the
    kernels that also quantize it (x_int8, x_int8_groups)."""
    cols = first + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:  # gate and up come from the kernel before
        tl.wait_prior_grid()
        tl.launch_dependents()
    g = tl.load(gate + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    return _act(g, ACT) * u, cols, mask


def gated_act_kernel(gate, up, out, n_cols, gate_stride, up_stride, out_stride, BLOCK: tl.constexpr,
                     ACT: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    y, cols, mask = gated_row(gate, up, row, tl.program_id(1) * BLOCK, n_cols, gate_stride, up_stride, BLOCK, ACT,
                              PDL)
    tl.store(out + row * out_stride + cols, y, mask=mask)


# (the arrays' shapes, strides and dtypes, act, block, target, pdl) -> (launch on its grid, the integer arguments)
_PLANS = Plans()


def gated_act(gate, up, act: str = "silu", *, out=None, block: int = 1024, target: str = "numpy",
              pdl: bool | None = None):
    """act(gate) * up for gate, up [T, I]; out [T, I] (gate's dtype by default)."""
    return gated_act_launched(gate, up, act, out=out, block=block, target=target, pdl=pdl)[0]


def gated_act_launched(gate, up, act: str = "silu", *, out=None, block: int = 1024, target: str = "numpy",
                       pdl: bool | None = None) -> tuple:
    """(gated_act's result, (launch, its arguments)): a caller passing the same arrays again (an eager step's kept
    buffers, backends/cuda/step_arena.py) may call launch(*arguments) for the same result."""
    fresh = out is None  # made here: its shape, strides and dtype follow from gate's
    if out is None:
        out = np.empty(gate.shape, gate.dtype) if isinstance(gate, np.ndarray) else gate.new_empty(gate.shape)
    key = None
    if type(gate) is not np.ndarray:  # a runner's: the kernel and grid of these shapes are kept
        key = (signature(gate, up, None if fresh else out), act, block, target, pdl)
        if (plan := _PLANS.get(key)) is not None:
            args = (gate, up, out, *plan[1])
            plan[0](*args)
            return out, (plan[0], args)
    n = gate.shape[1]
    block = min(block, tl.next_power_of_2(n))
    pdl = use_pdl(target, pdl)
    k = compile(gated_act_kernel, target, launch_pdl=pdl, BLOCK=block, ACT=act, PDL=pdl)
    launch = k.bind((gate.shape[0], tl.cdiv(n, block)))
    ints = (n, elem_stride(gate, 0), elem_stride(up, 0), elem_stride(out, 0))
    launch(gate, up, out, *ints)
    if key is not None:
        _PLANS.put(key, (launch, ints))
    return out, (launch, (gate, up, out, *ints))


def gated_act_fused(gate_up, act: str = "silu", *, out=None, block: int = 1024, target: str = "numpy",
                    pdl: bool | None = None):
    """act(gate) * up on a fused [T, 2I] projection (gate first)."""
    i = gate_up.shape[1] // 2
    return gated_act(gate_up[:, :i], gate_up[:, i:], act, out=out, block=block, target=target, pdl=pdl)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float32)


def gated_act_ref(gate: np.ndarray, up: np.ndarray, act: str = "silu") -> np.ndarray:
    g, u = gate.astype(np.float32), up.astype(np.float32)
    if act == "silu":
        a = g / (1 + np.exp(-g))
    elif act == "gelu":
        a = 0.5 * g * (1 + _erf(g / np.sqrt(2.0)))
    elif act == "gelu_tanh":
        a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    else:
        raise ValueError(f"unknown activation {act!r}")
    return (a * u).astype(gate.dtype)
