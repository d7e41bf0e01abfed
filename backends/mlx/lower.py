"""Runs an IR graph with mlx ops: each IR op is one small function here."""

from __future__ import annotations

import math

import numpy as np

from backends.mlx.attention import AttentionMeta, paged_attention
from backends.mlx.runtime import mx
from backends.mlx.weights import QuantLinear
from core.batch import Batch
from ir.graph import Graph, Node, Value
from ir.rope import RopeSpec, cos_sin, token_seq_lens


def _linear(x, w, b=None):
    y = w.matmul(x) if isinstance(w, QuantLinear) else x @ w.T
    return y if b is None else y + b


def _embedding(table, ids):
    return table.rows(ids) if isinstance(table, QuantLinear) else table[ids]


def _gelu(x):
    return 0.5 * x * (1 + mx.erf(x * (1 / math.sqrt(2))))


def _gelu_tanh(x):
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def _rms_norm(x, w, eps, offset=0.0):
    return mx.fast.rms_norm(x, w + offset if offset else w, eps)


def _layer_norm(x, w, b=None, *, eps):
    if w.ndim == 1:
        return mx.fast.layer_norm(x, w, b, eps)
    y = mx.fast.layer_norm(x, None, None, eps) * w  # a per-head weight [heads, d]: mlx's takes [d] only
    return y if b is None else y + b


OPS = {
    "embedding": _embedding,
    "linear": _linear,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "silu": lambda x: x * mx.sigmoid(x),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "softcap": lambda x, cap: cap * mx.tanh(x / cap),
    "scale": lambda x, factor: x * factor,
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "gather_rows": lambda x, indices: x[indices],
}


class StepContext:
    """What one forward step shares across layers: attention metadata and rope tables (`seq_lens`, each token's
    sequence length, picks longrope's table)."""

    group_metas: list[AttentionMeta] = []  # one per KV group (core.kv_layout) when there are several
    group_of: tuple[int, ...] = ()  # layer -> its KV group

    def __init__(self, meta: AttentionMeta, positions: np.ndarray, dtype, seq_lens: np.ndarray | None = None):
        self.meta = meta
        self.positions = positions
        self.seq_lens = seq_lens
        self.dtype = dtype
        self._rope: dict[RopeSpec, tuple[mx.array, mx.array]] = {}

    @classmethod
    def for_batch(cls, batch: Batch, meta: AttentionMeta, dtype) -> StepContext:
        return cls(meta, batch.positions, dtype, token_seq_lens(batch.context_lens, batch.query_start))

    def attention_meta(self, layer: int) -> AttentionMeta:
        """The metadata of `layer`'s KV group (`meta` for a model of one group)."""
        return self.group_metas[self.group_of[layer]] if self.group_of else self.meta

    def cos_sin(self, spec: RopeSpec):
        if spec not in self._rope:
            cos, sin = cos_sin(spec, self.positions, self.seq_lens)
            self._rope[spec] = (mx.array(cos[:, None, :]).astype(self.dtype),
                                mx.array(sin[:, None, :]).astype(self.dtype))
        return self._rope[spec]


def _rope(x, ctx: StepContext, spec: RopeSpec):
    cos, sin = ctx.cos_sin(spec)
    d = spec.rotary_dim
    rot = x[..., :d] if d < x.shape[-1] else x
    if spec.style == "neox":
        a, b = rot[..., : d // 2], rot[..., d // 2:]
        out = mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return out if d == x.shape[-1] else mx.concatenate([out, x[..., d:]], axis=-1)


class GraphRunner:
    """Evaluates `graph` on mlx arrays. `kv` holds per-layer [k_cache, v_cache], updated in place."""

    def __init__(self, graph: Graph, params: dict, dtype, kernels=None):
        self.graph = graph
        self.params = params
        self.dtype = dtype
        self.kernels = kernels  # backends.mlx.metal_ops.KernelOps, or None for plain mlx ops
        # value id -> (activation, its input) for activations whose only use is a mul: a gated kernel
        uses: dict[int, int] = {}
        for node in graph.nodes:
            for v in node.inputs:
                if v is not None:
                    uses[v.id] = uses.get(v.id, 0) + 1
        self.gate_of = {n.out.id: (n.op, n.inputs[0]) for n in graph.nodes
                        if n.op in ("silu", "gelu", "gelu_tanh") and uses.get(n.out.id) == 1}

    def run(self, inputs: dict[str, mx.array], ctx: StepContext, kv: list[list[mx.array]]) -> dict[str, mx.array]:
        # Positions and the attention inputs reach their ops through `ctx`, already prepared.
        env: dict[int, mx.array | None] = {v.id: inputs.get(name) for name, v in self.graph.inputs.items()}

        def get(v: Value | None):
            if v is None:
                return None
            return self.params[v.name] if v.kind == "param" else env[v.id]

        for node in self.graph.nodes:
            if self.kernels is not None and node.op == "mul" and node.inputs[0].id in self.gate_of:
                act, gate = self.gate_of[node.inputs[0].id]
                env[node.out.id] = self.kernels.gated(act, env[gate.id], env[node.inputs[1].id])
                continue
            env[node.out.id] = self._eval(node, [get(i) for i in node.inputs], ctx, kv)
        return {k: env[v.id] for k, v in self.graph.outputs.items()}

    def _eval(self, node: Node, args: list, ctx: StepContext, kv):
        a = node.attrs
        if node.op == "attention":
            layer = a["layer"]
            out, kv[layer][0], kv[layer][1] = paged_attention(
                args[0], args[1], args[2], kv[layer][0], kv[layer][1], ctx.attention_meta(layer), scale=a["scale"],
                sliding_window=a.get("sliding_window"), softcap=a.get("softcap"), kernels=self.kernels)
            return out
        if node.op == "rope":
            return _rope(args[0], ctx, a["spec"])
        if node.op == "rms_norm" and self.kernels is not None and a.get("offset", 0.0) in (0.0, 1.0):
            return self.kernels.rms_norm(args[0], args[1], a["eps"], a.get("offset", 0.0))
        if node.op == "reshape":
            shape = [-1 if isinstance(d, str) else d for d in a["shape"]]
            return args[0].reshape(shape)
        while args and args[-1] is None:  # absent optional operands (a bias)
            args = args[:-1]
        return OPS[node.op](*args, **a)
