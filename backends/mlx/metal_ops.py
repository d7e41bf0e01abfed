"""The DSL's kernels inside the MLX backend: rms_norm, gated activations and paged decode attention,
compiled to Metal (`mx.fast.metal_kernel`) and used when `mx.metal.is_available()`; elsewhere the
backend keeps its mlx-op path.

The launch plumbing (constexprs, strides, grids, which pointers come back as fresh outputs) is
written over a target. On a machine without Metal the very same code runs with target "simt-cpu",
the DSL's CPU execution of the lowered SIMT program that the Metal source is rendered from, on
numpy copies: that is how CI checks this wiring against the mlx-op path.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from backends.mlx import metal_kernel  # noqa: F401  (registers the DSL's "metal" launcher)
from backends.mlx.runtime import mx
from kernels_src.activations import gated_act_kernel
from kernels_src.dsl import compile, tl
from kernels_src.paged_attention import NO_WINDOW, num_partitions, paged_decode_kernel, paged_decode_reduce_kernel
from kernels_src.rms_norm import rms_norm_kernel

PARTITION, BLOCK_N = 512, 64
ACTS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


class KernelOps:
    """Each method takes and returns mlx arrays."""

    def __init__(self, target: str = "metal"):
        self.target = target
        self.metal = target == "metal"
        self.launches: Counter[str] = Counter()  # per method, for logs and tests

    # Metal kernels take mlx arrays and return written pointers as fresh arrays; the CPU oracle takes
    # numpy arrays and writes in place.
    def _in(self, a: mx.array):
        return a if self.metal else np.array(a)

    def _out(self, like, shape, dtype=None):
        if self.metal:
            return mx.zeros(shape, dtype or like.dtype)  # only its shape and dtype reach the kernel
        return np.full(shape, np.nan, dtype=np.dtype(dtype) if dtype is not None else like.dtype)

    def _launch(self, kern, grid, args, name, out):
        res = kern[grid](*args)
        return mx.array(res[name] if isinstance(res, dict) else out) if not self.metal else res[name]

    def rms_norm(self, x: mx.array, w: mx.array, eps: float, offset: float = 0.0) -> mx.array:
        self.launches["rms_norm"] += 1
        if offset not in (0.0, 1.0):
            raise ValueError("the rms_norm kernel supports an offset of 0 or 1 (Gemma)")
        n = x.shape[-1]
        rows = self._in(x.reshape(-1, n))
        out = self._out(rows, rows.shape)
        k = compile(rms_norm_kernel, self.target, BLOCK=tl.next_power_of_2(n), OFFSET=bool(offset))
        res = self._launch(k, rows.shape[0], (rows, self._in(w), out, n, n, n, float(eps)), "out", out)
        return res.reshape(x.shape)

    def gated(self, act: str, gate: mx.array, up: mx.array, block: int = 1024) -> mx.array:
        self.launches["gated"] += 1
        n = gate.shape[-1]
        g, u = self._in(gate.reshape(-1, n)), self._in(up.reshape(-1, n))
        out = self._out(g, g.shape)
        k = compile(gated_act_kernel, self.target, BLOCK=block, ACT=ACTS[act])
        res = self._launch(k, (g.shape[0], tl.cdiv(n, block)), (g, u, out, n, n, n, n), "out", out)
        return res.reshape(gate.shape)

    def paged_decode(self, q: mx.array, kc: mx.array, vc: mx.array, slots_per_block: int, block_tables: mx.array,
                     context_lens: mx.array, max_context: int, scale: float, window: int | None,
                     softcap: float | None) -> mx.array:
        """q [B, Hq, D]; caches [num_slots, Hkv, D] viewed as [blocks, block_size, Hkv, D]."""
        self.launches["paged_decode"] += 1
        n_seq, hq, d = q.shape
        hkv = kc.shape[1]
        bs = slots_per_block
        kc4 = self._in(kc.reshape(-1, bs, hkv, d))
        vc4 = self._in(vc.reshape(-1, bs, hkv, d))
        qa, tables, ctx = self._in(q), self._in(block_tables), self._in(context_lens)
        n_parts = num_partitions(max_context, PARTITION)
        split = n_parts > 1
        out = self._out(qa, q.shape)
        ws = [self._out(qa, (n_seq, hq, n_parts), mx.float32 if self.metal else np.float32) for _ in range(2)]
        ws.append(self._out(qa, (n_seq, hq, n_parts, d), mx.float32 if self.metal else np.float32))
        group = hq // hkv
        consts = dict(GROUP=group, HEAD_DIM=d, BLOCK_G=max(16, tl.next_power_of_2(group)),
                      BLOCK_D=max(16, tl.next_power_of_2(d)), BLOCK_N=BLOCK_N, BS=bs, PARTITION=PARTITION,
                      SPLIT=split, SOFTCAP=bool(softcap))
        kern = compile(paged_decode_kernel, self.target, **consts)
        ks = _contiguous_strides(tuple(kc4.shape))
        args = (qa, kc4, vc4, tables, ctx, out, *ws, float(scale), float(softcap or 0.0), int(window or NO_WINDOW),
                n_parts, hq * d, d, hq * d, d, tables.shape[1], ks[0], ks[1], ks[2])
        res = kern[n_seq, hkv, n_parts](*args)
        if not split:
            return (res["out"] if self.metal else mx.array(out))
        m, den, acc = (res["part_m"], res["part_l"], res["part_acc"]) if self.metal else ws
        red = compile(paged_decode_reduce_kernel, self.target, HEAD_DIM=d, BLOCK_D=consts["BLOCK_D"],
                      PARTITION=PARTITION, BLOCK_N=BLOCK_N)
        res = red[n_seq, hq](m, den, acc, ctx, out, n_parts, hq * d, d)
        return res["out"] if self.metal else mx.array(out)
