"""Runs an IR graph with mlx ops: each IR op is one small function here."""

from __future__ import annotations

import math

import numpy as np

from backends.mlx import distributed, kv_quant
from backends.mlx.attention import AttentionMeta, latent_attention, paged_attention
from backends.mlx.runtime import mx
from backends.mlx.weights import QuantLinear
from core.batch import Batch
from ir.graph import Graph, Node, Value
from ir.rope import RopeSpec, cos_sin, token_seq_lens


def _linear(x, w, b=None):
    y = w.matmul(x) if isinstance(w, QuantLinear) else x @ w.T
    return y if b is None else y + b


def _embedding(table, ids, vocab_start: int | None = None):
    if vocab_start is not None:  # a vocab-parallel shard: its rows, zeros for the ids of other ranks
        local = ids - vocab_start
        rows = table.wq.shape[0] if isinstance(table, QuantLinear) else table.shape[0]
        inside = (local >= 0) & (local < rows)
        out = _embedding(table, mx.where(inside, local, 0))
        return out * inside[..., None].astype(out.dtype)
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


def _moe_route(logits, bias=None, *, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = False,
               routed_scaling: float = 1.0, n_group: int = 1, topk_group: int = 1, group_score: str = "max"):
    x = logits.astype(mx.float32)
    scores = mx.softmax(x, axis=-1) if scoring == "softmax" else mx.sigmoid(x)
    choice = scores if bias is None else scores + bias
    if topk_group < n_group:  # only the best topk_group groups' experts may be chosen
        grouped = choice.reshape(choice.shape[0], n_group, -1)
        top = mx.sort(grouped, axis=-1)
        g = top[..., -1] if group_score == "max" else top[..., -2:].sum(-1)
        drop = mx.argpartition(g, kth=n_group - topk_group - 1, axis=-1)[..., :n_group - topk_group]
        mask = mx.put_along_axis(mx.zeros(g.shape), drop, mx.array(1.0), axis=-1)
        choice = mx.where(mx.repeat(mask, grouped.shape[-1], axis=-1) > 0, -mx.inf, choice)
    ids = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]  # the top k, in no order: a sum follows
    w = mx.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * routed_scaling, ids.astype(mx.int32)


def _bcast(x, y):
    lead = tuple(max(a, b) for a, b in zip(x.shape[:-1], y.shape[:-1], strict=True))
    return mx.broadcast_to(x, (*lead, x.shape[-1])), mx.broadcast_to(y, (*lead, y.shape[-1]))


def _expert_mm(x, w, ids):
    """x [T, k, 1, in] (or [T, 1, 1, in]) through each slot's expert of the stack w [E, out, in]: [T, k, 1, out]."""
    if isinstance(w, QuantLinear):
        return mx.gather_qmm(x, w.wq, w.scales, w.biases, rhs_indices=ids, transpose=True, group_size=w.group_size,
                             bits=w.bits)
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=ids)


def _moe_experts(x, weights, ids, w_gate, w_up, w_down, *, act: str):
    """mlx-lm's switch-GLU: gather_mm picks each (token, slot)'s expert matrix, no per-expert loop."""
    xe = x[:, None, None, :]
    h = OPS[act](_expert_mm(xe, w_gate, ids)) * _expert_mm(xe, w_up, ids)
    y = _expert_mm(h, w_down, ids)[:, :, 0, :]  # [T, k, hidden]
    return (y * weights[..., None].astype(y.dtype)).sum(axis=1)


OPS = {
    "embedding": _embedding,
    "linear": _linear,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "silu": lambda x: x * mx.sigmoid(x),
    "sigmoid": mx.sigmoid,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "softcap": lambda x, cap: cap * mx.tanh(x / cap),
    "scale": lambda x, factor: x * factor,
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "gather_rows": lambda x, indices: x[indices],
    "head_linear": lambda x, w: (x.transpose(1, 0, 2) @ w.swapaxes(-1, -2)).transpose(1, 0, 2),
    "concat": lambda x, y: mx.concatenate(_bcast(x, y), axis=-1),
    "moe_route": _moe_route,
    "moe_experts": _moe_experts,
    "all_reduce": distributed.all_reduce,
    "all_gather": distributed.all_gather,
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
    """Evaluates `graph` (ir.fusion's output) on mlx arrays. `kv` holds per-layer [k_cache, v_cache] ([latent_cache]
    for a latent layer), each cache three arrays with `kv_int8` (backends.mlx.kv_quant), updated in place."""

    def __init__(self, graph: Graph, params: dict, dtype, kernels=None, kv_int8: bool = False):
        self.graph = graph
        self.params = params
        self.dtype = dtype
        self.kernels = kernels  # backends.mlx.metal_ops.KernelOps, or None for plain mlx ops
        self.kv_int8 = kv_int8

    def run(self, inputs: dict[str, mx.array], ctx: StepContext, kv: list[list[mx.array]]) -> dict[str, mx.array]:
        # Positions and the attention inputs reach their ops through `ctx`, already prepared.
        env: dict[int, mx.array | None] = {v.id: inputs.get(name) for name, v in self.graph.inputs.items()}

        def get(v: Value | None):
            if v is None:
                return None
            return self.params[v.name] if v.kind == "param" else env[v.id]

        for node in self.graph.nodes:
            out = self._eval(node, [get(i) for i in node.inputs], ctx, kv)
            for v, a in zip(node.outs, out if len(node.outs) > 1 else (out,), strict=True):
                env[v.id] = a
        return {k: env[v.id] for k, v in self.graph.outputs.items()}

    def _eval(self, node: Node, args: list, ctx: StepContext, kv):
        a, op = node.attrs, node.op
        if op in ("attention", "rope_attention"):
            q, k, v = args[:3]
            if op == "rope_attention":
                q, k = _rope(q, ctx, a["spec"]), _rope(k, ctx, a["spec"])
            layer = a["layer"]
            kc, vc = kv_quant.pack(kv[layer], self.kv_int8)
            out, kc, vc = paged_attention(
                q, k, v, kc, vc, ctx.attention_meta(layer), scale=a["scale"],
                sliding_window=a.get("sliding_window"), softcap=a.get("softcap"), kernels=self.kernels)
            kv[layer][:] = kv_quant.flat([kc, vc])
            return out
        if op == "latent_attention":
            layer = a["layer"]
            (kc,) = kv_quant.pack(kv[layer], self.kv_int8)
            out, kc = latent_attention(
                args[0], args[1], kc, ctx.attention_meta(layer), value_dim=a["value_dim"], scale=a["scale"],
                sliding_window=a.get("sliding_window"), softcap=a.get("softcap"), kernels=self.kernels)
            kv[layer][:] = kv_quant.flat([kc])
            return out
        if op == "rope":
            return _rope(args[0], ctx, a["spec"])
        if op == "rope_pair":
            return _rope(args[0], ctx, a["spec"]), _rope(args[1], ctx, a["spec"])
        if op == "slice":
            return args[0][..., a["start"]:a["start"] + a["size"]]
        if op == "gated":
            if self.kernels is not None:
                return self.kernels.gated(a["act"], args[0], args[1])
            return OPS[a["act"]](args[0]) * args[1]
        if op == "add_rms_norm":
            s = args[0] + args[1]
            return s, self._rms_norm(s, args[2], a["eps"], a.get("offset", 0.0))
        if op == "rms_norm":
            return self._rms_norm(args[0], args[1], a["eps"], a.get("offset", 0.0))
        if node.op == "reshape":
            shape = [-1 if isinstance(d, str) else d for d in a["shape"]]
            return args[0].reshape(shape)
        while args and args[-1] is None:  # absent optional operands (a bias)
            args = args[:-1]
        return OPS[op](*args, **a)

    def _rms_norm(self, x, w, eps: float, offset: float):
        if self.kernels is not None and offset in (0.0, 1.0):
            return self.kernels.rms_norm(x, w, eps, offset)
        return _rms_norm(x, w, eps, offset)
