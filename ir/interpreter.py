"""The reference semantics of the IR: a plain numpy interpreter in fp32.

Every backend is checked against what this computes. Clarity beats speed here, but it must still run
a 135M model in seconds, so weights are dequantized once and kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from core.batch import group_input_names
from ir.graph import Graph, Node, Value
from ir.kv_groups import kv_layout
from ir.rope import RopeSpec, cos_sin, token_seq_lens


@dataclass
class KVCache:
    """Per-layer paged key and value caches, each [num_blocks, block_size, kv_heads, head_dim], a layer's blocks
    those of its KV group's pool (core.kv_layout); a latent layer's values are its keys' leading part (v None).
    `steps` holds the running step's slot mappings and block tables of groups 1.. (group 0's are the graph's own
    inputs), bound by Interpreter.run."""

    k: list[np.ndarray]
    v: list[np.ndarray | None]
    block_size: int
    group_of: tuple[int, ...] = ()  # layer -> KV group; () : one group
    steps: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    @classmethod
    def for_graph(cls, graph: Graph, num_blocks: int | Sequence[int], block_size: int) -> KVCache:
        """`num_blocks`: every pool's size, or one per KV group."""
        layout = kv_layout(graph)
        pools = [num_blocks] * layout.num_groups if isinstance(num_blocks, int) else list(num_blocks)
        if len(pools) != layout.num_groups:
            raise ValueError(f"{len(pools)} pool sizes for {layout.num_groups} KV groups")
        k, v = [], []
        for s, g in zip(layout.shapes, layout.group_of, strict=True):
            k.append(np.zeros((pools[g], block_size, s.heads, s.key_dim), np.float32))
            v.append(None if s.values_in_keys else np.zeros((pools[g], block_size, s.heads, s.value_dim), np.float32))
        return cls(k, v, block_size, layout.group_of if layout.num_groups > 1 else ())

    def bind(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Takes the step's tables of groups 1.. from Batch.inputs()."""
        groups = 1 + max(self.group_of, default=0)
        missing = [n for g in range(1, groups) for n in group_input_names(g) if n not in inputs]
        if missing:
            raise KeyError(f"this model has {groups} KV groups: the step lacks {', '.join(missing)}")
        self.steps = [tuple(np.asarray(inputs[n]) for n in group_input_names(g)) for g in range(1, groups)]

    def tables(self, layer: int, slots: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot mapping, block tables) of `layer`'s group, given group 0's."""
        g = self.group_of[layer] if self.group_of else 0
        return (slots, tables) if g == 0 else self.steps[g - 1]


def _rms_norm(x, w, eps, offset=0.0):
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * (w + np.float32(offset))


def _layer_norm(x, w, b=None, *, eps):
    mu = x.mean(-1, keepdims=True)
    var = np.square(x - mu).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + np.float32(eps)) * w
    return y if b is None else y + b


def _rope(x, positions, spec: RopeSpec, seq_lens=None):
    cos, sin = cos_sin(spec, positions, seq_lens)
    cos, sin = cos[:, None, :], sin[:, None, :]
    d = spec.rotary_dim
    rot, rest = x[..., :d], x[..., d:]
    if spec.style == "neox":
        a, b = rot[..., : d // 2], rot[..., d // 2 :]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    elif spec.style == "interleaved":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    else:
        raise ValueError(f"unknown rope style {spec.style!r}")
    return np.concatenate([out, rest], axis=-1).astype(np.float32)


def _softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def paged_attention(q, k, v, slots, tables, ctx, qstart, *, cache: KVCache, layer: int, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None):
    """The contract of `core.batch`, written as plainly as possible: write this step's k/v, then attend (through
    the tables of the layer's KV group)."""
    kc, vc = cache.k[layer], cache.v[layer]
    slots, tables = cache.tables(layer, slots, tables)
    flat_k = kc.reshape(-1, *kc.shape[2:])
    flat_v = vc.reshape(-1, *vc.shape[2:])
    keep = slots >= 0
    flat_k[slots[keep]] = k[keep]
    flat_v[slots[keep]] = v[keep]
    return attend_cached(q, kc, vc, tables, ctx, qstart, scale=scale, sliding_window=sliding_window,
                         softcap=softcap)


def latent_attention(q, kv, slots, tables, ctx, qstart, *, cache: KVCache, layer: int, scale: float, value_dim: int,
                     sliding_window: int | None = None, softcap: float | None = None):
    """MLA over its latent cache: this step's latents kv [T, Hkv, D] written as keys, then attention whose values are
    the cached keys' first value_dim elements."""
    kc = cache.k[layer]
    slots, tables = cache.tables(layer, slots, tables)
    flat = kc.reshape(-1, *kc.shape[2:])
    keep = slots >= 0
    flat[slots[keep]] = kv[keep]
    return attend_cached(q, kc, kc[..., :value_dim], tables, ctx, qstart, scale=scale, sliding_window=sliding_window,
                         softcap=softcap)


def attend_cached(q, k_cache, v_cache, tables, ctx, qstart, *, scale: float, sliding_window: int | None = None,
                  softcap: float | None = None) -> np.ndarray:
    """Attention of flat varlen q [T, Hq, D] over caches [blocks, block_size, Hkv, D] already holding every
    token's k/v; the kernels' references call this too."""
    bs = k_cache.shape[1]
    flat_k = np.asarray(k_cache, np.float32).reshape(-1, *k_cache.shape[2:])
    flat_v = np.asarray(v_cache, np.float32).reshape(-1, *v_cache.shape[2:])
    q = np.asarray(q, np.float32)
    tables, ctx, qstart = (np.asarray(a) for a in (tables, ctx, qstart))
    hq, hkv = q.shape[1], flat_k.shape[1]
    out = np.zeros((q.shape[0], hq, flat_v.shape[2]), np.float32)
    for b in range(len(ctx)):
        s, e, n_ctx = int(qstart[b]), int(qstart[b + 1]), int(ctx[b])
        if e == s:
            continue
        j = np.arange(n_ctx)
        kv_slots = tables[b, j // bs].astype(np.int64) * bs + j % bs
        keys = np.repeat(flat_k[kv_slots], hq // hkv, axis=1)  # [L, hq, d]
        vals = np.repeat(flat_v[kv_slots], hq // hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[s:e], keys) * np.float32(scale)
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        qi = n_ctx - (e - s) + np.arange(e - s)
        mask = j[None, :] <= qi[:, None]
        if sliding_window:
            mask &= j[None, :] > qi[:, None] - sliding_window
        probs = _softmax(np.where(mask[None], scores, -np.inf))
        out[s:e] = np.einsum("hqk,khd->qhd", probs, vals)
    return out


def _gelu(x):
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(np.float32)


def _gelu_tanh(x):
    return (0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))).astype(np.float32)


def _linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def moe_route(logits, bias=None, *, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = False,
              routed_scaling: float = 1.0, n_group: int = 1, topk_group: int = 1, group_score: str = "max"):
    """Each token's top_k experts and their weights: scores by softmax (over all experts) or sigmoid; a correction
    bias (DeepSeek-V3's) moves the choice, not the weights. With groups (DeepSeek's), experts are chosen only from
    the topk_group groups of n_group whose score (their best expert's, or their best two's sum) is highest."""
    x = logits.astype(np.float32)
    scores = _softmax(x) if scoring == "softmax" else 1 / (1 + np.exp(-x))
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        grouped = choice.reshape(len(choice), n_group, -1)
        top = -np.sort(-grouped, axis=-1)
        g = top[..., 0] if group_score == "max" else top[..., :2].sum(-1)
        keep = np.argsort(-g, axis=-1, kind="stable")[:, :topk_group]
        mask = np.zeros(g.shape, bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, grouped.shape[-1], axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    return (w * np.float32(routed_scaling)).astype(np.float32), ids.astype(np.int32)


def moe_experts(x, weights, ids, w_gate, w_up, w_down, *, act: str):
    """Every (token, slot) through its expert's gated MLP, weighted and summed; one expert at a time."""
    out = np.zeros((x.shape[0], w_down.shape[1]), np.float32)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        h = KERNELS[act](x[tok] @ w_gate[e].T) * (x[tok] @ w_up[e].T)
        np.add.at(out, tok, weights[tok, slot, None] * (h @ w_down[e].T))
    return out


def _bcast(x, y):
    """x and y broadcast on every dim but the last (for concat)."""
    lead = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    return np.broadcast_to(x, (*lead, x.shape[-1])), np.broadcast_to(y, (*lead, y.shape[-1]))


def _seq_lens(context_lens, query_start):
    return None if context_lens is None else token_seq_lens(context_lens, query_start)


def _add_rms_norm(x, y, w, *, eps, offset=0.0):
    s = x + y
    return s, _rms_norm(s, w, eps, offset)


def _rope_pair(q, k, positions, context_lens=None, query_start=None, *, spec):
    lens = _seq_lens(context_lens, query_start)
    return _rope(q, positions, spec, lens), _rope(k, positions, spec, lens)


def rope_attention(q, k, v, positions, slots, tables, ctx, qstart, *, cache: KVCache, spec: RopeSpec, **attrs):
    lens = token_seq_lens(ctx, qstart)
    return paged_attention(_rope(q, positions, spec, lens), _rope(k, positions, spec, lens), v, slots, tables, ctx,
                           qstart, cache=cache, **attrs)


def _embedding(table, ids, vocab_start=None, **_):
    if vocab_start is None:
        return table[ids]
    local = ids - vocab_start  # a vocab-parallel shard: its rows only, zeros elsewhere (the all_reduce sums them)
    inside = (local >= 0) & (local < len(table))
    return np.where(inside[..., None], table[np.where(inside, local, 0)], np.float32(0))


KERNELS: dict[str, Callable] = {
    "embedding": _embedding,
    "linear": _linear,
    "rms_norm": lambda x, w, eps, offset=0.0: _rms_norm(x, w, eps, offset),
    "layer_norm": _layer_norm,
    "rope": lambda x, positions, context_lens=None, query_start=None, *, spec: _rope(
        x, positions, spec, _seq_lens(context_lens, query_start)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "softcap": lambda x, cap: cap * np.tanh(x / cap),
    "scale": lambda x, factor: x * np.float32(factor),
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "gather_rows": lambda x, indices: x[indices],
    "head_linear": lambda x, w: np.einsum("thi,hoi->tho", x, w),
    "moe_route": moe_route,
    "moe_experts": moe_experts,
    "slice": lambda x, start, size: x[..., start:start + size],
    "concat": lambda x, y: np.concatenate(_bcast(x, y), axis=-1),
    # the fused ops (ir.fusion): each what its plainer ops computed
    "gated": lambda gate, up, act: KERNELS[act](gate) * up,
    "add_rms_norm": _add_rms_norm,
    "rope_pair": _rope_pair,
}


_NP = {"f32": np.float32, "f16": np.float32, "bf16": np.float32, "i32": np.int32}


# (the collective node, this rank's x) -> the result over every rank: what a rank's graph (ir.sharding) needs.
Collective = Callable[[Node, np.ndarray], np.ndarray]


def single_process(node: Node, x: np.ndarray) -> np.ndarray:
    """The collectives of a world of one: the sum and the gather of x alone are x."""
    if node.attrs.get("world", 1) != 1:
        raise ValueError(f"{node.op} over {node.attrs['world']} ranks needs a multi-rank run (ir.tp_reference)")
    return x


class Interpreter:
    """Runs a graph on numpy arrays. `weights` maps parameter names to arrays (any float dtype) or to
    objects with a `dequantize()` method; both become fp32 once, on first use. `collective` runs all_reduce and
    all_gather (a rank's graph, ir.sharding); by default they are those of one process."""

    def __init__(self, graph: Graph, weights: Mapping[str, object], collective: Collective = single_process):
        missing = [p for p in graph.params if p not in weights]
        if missing:
            raise KeyError(f"weights missing for parameters: {', '.join(missing[:8])}")
        self.graph = graph
        self._weights = weights
        self._dense: dict[str, np.ndarray] = {}
        self.collective = collective

    def param(self, name: str) -> np.ndarray:
        if name not in self._dense:
            w = self._weights[name]
            arr = w.dequantize() if hasattr(w, "dequantize") else np.asarray(w)
            shape = self.graph.params[name].shape
            self._dense[name] = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        return self._dense[name]

    def run(self, inputs: Mapping[str, np.ndarray], cache: KVCache) -> dict[str, np.ndarray]:
        env: dict[int, np.ndarray] = {}
        for name, v in self.graph.inputs.items():
            if name not in inputs:
                raise KeyError(f"graph input {name!r} not supplied")
            env[v.id] = np.asarray(inputs[name])
        cache.bind(inputs)

        def get(v: Value | None):
            if v is None:
                return None
            return self.param(v.name) if v.kind == "param" else env[v.id]

        for node in self.graph.nodes:
            out = self._eval(node, [get(i) for i in node.inputs], cache)
            for v, a in zip(node.outs, out if len(node.outs) > 1 else (out,), strict=True):
                env[v.id] = a
        return {k: env[v.id] for k, v in self.graph.outputs.items()}

    def _eval(self, node: Node, args: list, cache: KVCache):
        if node.op == "attention":
            return paged_attention(*args, cache=cache, **node.attrs)
        if node.op == "rope_attention":
            return rope_attention(*args, cache=cache, **node.attrs)
        if node.op == "latent_attention":
            return latent_attention(*args, cache=cache, **node.attrs)
        if node.op in ("all_reduce", "all_gather"):
            return np.asarray(self.collective(node, args[0]), dtype=np.float32)
        if node.op == "reshape":
            sizes = {d: n for d, n in zip(node.inputs[0].shape, args[0].shape, strict=True)}
            return args[0].reshape([sizes[d] if isinstance(d, str) else d for d in node.attrs["shape"]])
        while args and args[-1] is None:  # absent optional operands (a bias)
            args = args[:-1]
        out = KERNELS[node.op](*args, **node.attrs)
        if len(node.outs) > 1:  # each result in its declared dtype (a router's expert ids are i32)
            return tuple(np.asarray(a, dtype=_NP[v.dtype]) for a, v in zip(out, node.outs, strict=True))
        return np.asarray(out, dtype=np.float32)
