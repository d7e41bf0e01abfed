"""The runner's linear layer, x @ w.T (+ b), by the weight's kind and x's rows: a quantized weight's kernels
(gguf_linear, int_group_linear, fp8_linear), the DSL's dense GEMV (few rows, `Runner.dense_gemv`), its dense GEMM
(the problems its table lists, `Runner.dense_gemm`) or cuBLAS. In an eager decode step (the runner's step arena) the
result goes into the value's kept buffer and the launch is kept in the arena's memo, so the next step with the same
arrays launches it again without working anything out (backends/cuda/step_arena.py)."""

from __future__ import annotations

from backends.cuda import gemv_fusion, torch_ops, x_int8_fusion
from backends.cuda.fp8_linear import fp8_linear
from backends.cuda.gguf_linear import gguf_linear
from backends.cuda.int_group_linear import int_group_linear
from backends.cuda.runtime import torch
from backends.cuda.weights import Param, QuantWeight
from ir.weight_formats import weight_format
from kernels_src.dense_gemm import dense_matmul
from kernels_src.dense_gemm import launched as dense_gemm_launched
from kernels_src.dense_gemv import dense_gemv
from kernels_src.dense_gemv import launched as dense_gemv_launched

F = torch.nn.functional
DEQUANT_CHUNK_BYTES = 64 * 2**20  # scratch for one chunk of a dequantized weight


def linear(runner, x, w: Param, b=None, vid: int | None = None):
    """x @ w.T (+ b) as `runner` is set; `vid`: the result's value id, for the step's kept buffer where it has one."""
    arena = runner.step_arena
    kept = arena is not None and vid is not None and b is None  # an eager decode step's value, its buffer kept
    if kept and (last := arena.memo.get(vid)) is not None and last[1] is w:
        if last[0] is x:  # the arrays of its last launch (below): launch it again
            last[2](*last[3])
            return last[4]
        if last[0] is None:  # cuBLAS, as this node's x of these rows went last step
            return torch_ops.linear_into(x, w, _kept_gemm(arena, vid, x, w))
    launchable = kept and x.dim() == 2 and x.stride(-1) == 1  # by dense_gemv's or dense_gemm's kept launch
    if isinstance(w, QuantWeight):
        y = quant_linear(runner, x, w)
    elif runner.dense_gemv and gemv_fusion.gemv_rows(x, runner.gemv_max_rows) and gemv_fusion.gemv_weight(w):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a decode step's x: no views around the GEMV
        if launchable:
            y = _kept_linear(runner, dense_gemv_launched, arena, vid, x, w)
        else:
            y = dense_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, target=runner.target, pdl=runner.pdl)
        y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.shape[0])
    elif runner.dense_gemm and gemv_fusion.dense_gemm_takes(x, w):
        if launchable:
            y = _kept_linear(runner, dense_gemm_launched, arena, vid, x, w)
        else:
            y = dense_matmul(x.reshape(-1, x.shape[-1]), w, target=runner.target,
                             pdl=runner.pdl).reshape(*x.shape[:-1], w.shape[0])
    elif kept:
        y = torch_ops.linear_into(x, w, _kept_gemm(arena, vid, x, w))
        arena.memo[vid] = (None, w)  # the checks above need not run again for these rows
    else:
        y = F.linear(x, w)
    return y if b is None else y + b


def _kept_linear(runner, launched, arena, vid: int, x, w):
    """An eager decode step's x @ w.T by `launched` (dense_gemv's or dense_gemm's) into its kept buffer, the launch
    kept in the arena's memo for the same arrays next step (linear's first lines launch it again)."""
    out = arena.take(vid, (x.shape[0], w.shape[0]), x)
    y, again = launched(x, w, out=out, target=runner.target, pdl=runner.pdl)
    if again is not None and arena.holds(vid, out):
        arena.memo[vid] = (x, w, *again, y)
    return y


def _kept_gemm(arena, vid: int, x, w):
    """The kept buffer an eager step's cuBLAS GEMM writes (x 2-D of w's dtype), else None (it allocates)."""
    if x.dim() != 2 or x.dtype != w.dtype:
        return None
    return arena.take(vid, (x.shape[0], w.shape[0]), x)


def quant_linear(runner, x, w: QuantWeight):
    """x @ w.T for a quantized weight, by its format's family."""
    family = weight_format(w.qtype).family
    if family == "intgroup":
        return int_group_linear(x, w.data, w.qtype, w.shape, w.perm, runner.target, DEQUANT_CHUNK_BYTES,
                                pdl=runner.pdl, x_i8=x_int8_fusion.prequantized(runner, x))
    if family == "fp8":
        return fp8_linear(x, w.data, w.scales, DEQUANT_CHUNK_BYTES, runner.target, pdl=runner.pdl, blocks=w.blocks)
    return gguf_linear(x, w, runner.target, pdl=runner.pdl, mmq_variant=runner.mmq_variant,
                       mmq_max_rows=runner.mmq_max_rows, chunk_bytes=DEQUANT_CHUNK_BYTES, row_ids=runner._row_ids,
                       xq_d=x_int8_fusion.prequantized(runner, x))
