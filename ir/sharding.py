"""Tensor parallelism as an IR pass: one rank's graph, cut from the whole by its parameters' `shard` annotations.

- column: a matrix's output rows (q/k/v, gate/up, each expert's gate/up rows, a per-head norm's heads), whole heads
  to a rank where a reshape after the linear gives its rows heads;
- row: a matrix's input columns (o, down, each expert's down): the rank's partial sums are all-reduced at once, and
  a bias is added by rank 0 alone;
- heads: a per-head stack's first dim;
- the embedding and LM head are vocab-parallel: a rank holds a slice of the vocabulary's rows; its lookups read
  zeros outside it and are all-reduced, its logits gathered. A vocabulary the ranks do not divide stays whole.

Attention splits by whole KV groups (a KV head and the query heads that read it): rank r holds a contiguous range of
the KV groups, the ranges' sizes differing by one at most (the first kv_heads % world ranks one more), so each rank
keeps the model's GQA group and only its head counts differ (9 query / 3 KV heads over 2 ranks: 6 / 2 and 3 / 1);
o's input columns follow its query heads. KV heads fewer than the ranks are replicated: rank r holds KV head
r * kv_heads // world, and the ranks sharing a KV head split its group of query heads the same uneven way
(Qwen2.5-7B's 28 / 4 over 8 ranks: 4 and 3 query heads beside one KV head). A value split unevenly is only ever
all-reduced, never gathered.
The pass runs before ir.fusion, so both backends fuse the same rank's graph; a fused parameter's parts are each cut
here, so their concatenation is that rank's rows of the fused matrix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from math import prod

import numpy as np

from ir.graph import Graph, Node, Value
from ir.ops import OPS
from ir.weights import StoredTensor

log = logging.getLogger(__name__)

MAX_WORLD = 8
_PER_HEAD = ("reshape", "rope", "rms_norm", "layer_norm")  # ops a head's values pass through on their way to a cache


def check_world(world: int, unit: str = "processes") -> None:
    """A world size tensor parallel takes (a power of two up to MAX_WORLD), else a ValueError counting `unit`."""
    if not isinstance(world, int) or not 1 <= world <= MAX_WORLD or world & (world - 1):
        raise ValueError(f"tensor parallel runs on a power of two from 1 to {MAX_WORLD} {unit}, not {world!r}")


def shard(graph: Graph, rank: int, world: int) -> Graph:
    """Rank `rank`'s graph of `world` (the graph itself for one): its parameters cut (Param.cut), its values of
    local width, and the all_reduce and all_gather nodes that make its outputs those of the whole graph."""
    check_world(world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    if world == 1:
        return graph
    fused = sorted({n.op for n in graph.nodes if OPS[n.op].fused})
    if fused:
        raise ValueError(f"ir.sharding runs before ir.fusion, but the graph has fused ops {fused}")
    cuts = param_cuts(graph, rank, world)
    last = param_cuts(graph, world - 1, world) if rank != world - 1 else cuts
    width = {k: c[2] - c[1] for k, c in cuts.items()}
    uneven = {k for k, c in last.items() if c[2] - c[1] != width[k]}  # rank 0 holds the most, the last the least
    return _Rewriter(graph, cuts, rank, world, uneven).run()


# -- which slice of each parameter a rank holds --------------------------------------------------------------------

def _axis(shard_kind: str, ndim: int) -> int:
    if shard_kind == "row":
        return ndim - 1
    if shard_kind == "heads" or ndim == 1:
        return 0
    return ndim - 2  # column: the rows of each matrix (of a stack too)


def kv_group_range(groups: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous range [start, stop) of `groups` KV groups: sizes differ by one at most, the first
    groups % world ranks holding one more: rank 0 holds the most, so the KV block count it sizes from its own cache's
    bytes per block fits every rank's."""
    base, extra = divmod(groups, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


# A parameter's heads: (heads along its split axis, KV heads, the (query heads, KV heads) of the attention they reach)
Heads = tuple[int, bool, "tuple[int, int] | None"]


def _reaches(uses: dict[int, list[Node]], value: Value) -> tuple[Node, int] | None:
    """The KV-cache op `value` reaches through per-head ops only, and the operand it is there."""
    todo = [value]
    while todo:
        v = todo.pop()
        for n in uses.get(v.id, []):
            at = [i for i, x in enumerate(n.inputs) if x is not None and x.id == v.id]
            if OPS[n.op].kv_cache and at:
                return n, at[0]
            if n.op in _PER_HEAD and at == [0]:
                todo.extend(n.outs)
    return None


def _head_info(uses: dict[int, list[Node]], value: Value, heads: int) -> Heads:
    """(heads, whether KV, the attention's (query, KV) heads where a plain attention reads them at q, k or v)."""
    reached = _reaches(uses, value)
    if reached is None:
        return heads, False, None
    node, at = reached
    counts = (node.inputs[0].shape[1], node.inputs[1].shape[1]) if node.op in ("attention", "rope_attention") else None
    return heads, at in (1, 2), counts


def _heads(uses: dict[int, list[Node]], out: Value) -> Heads | None:
    """The heads of a linear's output that a reshape makes [T, heads, head_dim]."""
    for n in uses.get(out.id, []):
        shape = n.attrs.get("shape", ()) if n.op == "reshape" else ()
        if len(shape) == 3 and all(isinstance(d, int) for d in shape[1:]) and shape[1] * shape[2] == out.shape[-1]:
            return _head_info(uses, n.out, shape[1])
    return None


def _out_projections(graph: Graph, uses: dict[int, list[Node]]) -> dict[str, Heads]:
    """o's weight (row-split) -> the heads of the attention whose output its input columns are, reached from that
    output through reshapes and elementwise products (an output gate)."""
    out = {}
    for node in graph.attention_nodes():
        if node.op not in ("attention", "rope_attention"):
            continue
        counts = (node.inputs[0].shape[1], node.inputs[1].shape[1])
        todo = [node.out]
        while todo:
            v = todo.pop()
            for n in uses.get(v.id, []):
                w = n.inputs[1] if n.op == "linear" and n.inputs[0].id == v.id else None
                if w is not None and w.kind == "param" and graph.params[w.name].shard == "row":
                    out[w.name] = (counts[0], False, counts)
                elif n.op in ("reshape", "mul"):
                    todo.extend(n.outs)
    return out


def _head_span(heads: Heads, rank: int, world: int) -> tuple[int, int] | None:
    """(first head, count) of rank's heads, or None where they do not split (ValueError raised by the caller)."""
    n, kv, counts = heads
    if counts is not None and counts[0] % counts[1] == 0 and n in counts:
        q, groups = counts
        if groups >= world:
            start, stop = kv_group_range(groups, world, rank)
            per = n // groups  # 1 for KV heads, the GQA group for query heads (and o's columns)
            return start * per, (stop - start) * per
        share, group = world // groups, q // groups
        if world % groups == 0 and group >= share:  # each KV head replicated on `share` ranks, its group split
            g, (start, stop) = rank // share, kv_group_range(group, share, rank % share)
            return (g, 1) if kv else (g * group + start, stop - start)
    if n % world == 0:
        return rank * (n // world), n // world
    if kv and world % n == 0:
        return rank * n // world, 1
    return None


def _vocab_params(graph: Graph) -> set[str]:
    """The embedding tables and the LM head's weight and bias (a linear an output is made of, after elementwise
    ops such as a softcap)."""
    out = {n.inputs[0].name for n in graph.nodes if n.op == "embedding" and n.inputs[0].kind == "param"}
    made = {n.out.id: n for n in graph.nodes}
    for v in graph.outputs.values():
        node = made.get(v.id)
        while node is not None and node.op in ("softcap", "scale"):
            node = made.get(node.inputs[0].id)
        if node is not None and node.op == "linear":
            out |= {p.name for p in node.inputs[1:] if p is not None and p.kind == "param"}
    return out


def param_cuts(graph: Graph, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """Parameter -> (axis, start, stop) of rank's slice; parameters absent are held whole."""
    uses = graph.uses()
    groups: dict[str, Heads] = _out_projections(graph, uses)  # split parameter -> its heads along its axis
    for node in graph.nodes:
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if w is None or w.kind != "param" or graph.params[w.name].shard != "column":
            continue
        if node.op == "linear":
            heads = _heads(uses, node.out)
            for p in node.inputs[1:]:
                if heads is not None and p is not None and p.kind == "param":
                    groups[p.name] = heads
        elif node.op in ("rms_norm", "layer_norm") and len(w.shape) == 2:  # a per-head norm [heads, head_dim]
            groups[w.name] = _head_info(uses, node.out, w.shape[0])
    vocab = _vocab_params(graph)
    cuts = {}
    for name, p in graph.params.items():
        if p.shard is None:
            continue
        axis = _axis(p.shard, len(p.shape))
        size = p.shape[axis]
        heads = groups.get(name, (size, False, None))
        span, n = _head_span(heads, rank, world), heads[0]
        if span is not None:
            start, count = span
        elif name in vocab:
            log.info("%s: a vocabulary of %d rows does not split across %d ranks; each holds all of it", name, size,
                     world)
            continue
        else:
            raise ValueError(_refusal(name, p.shape, heads, size, axis, p.shard, world))
        unit = size // n
        cuts[name] = (axis, start * unit, (start + count) * unit)
    return cuts


def _refusal(name: str, shape: tuple, heads: Heads, size: int, axis: int, kind: str, world: int) -> str:
    n, _, counts = heads
    if n == size:
        return (f"tensor parallel over {world} ranks: {name} {list(shape)} has {n} {'rows' if axis == 0 else 'columns'}"
                f" along its {kind} split, which do not split evenly; use a world size that divides {n}")
    why = "which do not split evenly"
    if counts is not None:
        why = (f"of {counts[1]} KV groups: each rank needs a whole KV group at least, or, with fewer KV heads than "
               f"ranks, a world size that is a multiple of the KV heads and at most the query heads ({counts[0]})")
    return f"tensor parallel over {world} ranks: {name} {list(shape)} has {n} heads, {why}"


# -- the rank's graph ------------------------------------------------------------------------------------------------

class _Rewriter:
    """The nodes again on the rank's parameters, each value's split dim tracked (None: every rank has all of it)."""

    def __init__(self, graph: Graph, cuts: dict[str, tuple[int, int, int]], rank: int, world: int,
                 uneven: set[str] = frozenset()):
        self.src, self.cuts, self.rank, self.world, self.uneven = graph, cuts, rank, world, uneven
        self.g = Graph(graph.name, graph.dtype)
        self.vmap: dict[int, Value] = {}
        self.split: dict[int, int] = {}  # value id of the new graph -> the dim it is split along
        self.ragged: set[int] = set()  # split values whose width differs between ranks: all_gather cannot join them

    def run(self) -> Graph:
        for name, v in self.src.inputs.items():
            self.vmap[v.id] = self.g.input(name, v.shape, v.dtype)
        for node in self.src.nodes:
            self._node(node)
        for name, v in self.src.outputs.items():
            self.g.output(name, self._whole(self._get(v)))
        read = {v.name for n in self.g.nodes for v in n.inputs if v is not None and v.kind == "param"}
        self.g.params = {k: p for k, p in self.g.params.items() if k in read}
        self.g._param_values = {k: v for k, v in self.g._param_values.items() if k in read}
        return self.g

    def _get(self, v: Value | None) -> Value | None:
        if v is None:
            return None
        if v.kind != "param":
            return self.vmap[v.id]
        if v.name not in self.g.params:
            p, cut = self.src.params[v.name], self.cuts.get(v.name)
            shape = list(p.shape)
            if cut is not None:
                shape[cut[0]] = cut[2] - cut[1]
            self.g.param(v.name, tuple(shape), p.dtype, p.shard)
            self.g.params[v.name] = replace(self.g.params[v.name], cut=cut)
        return self.g._param_values[v.name]

    def _cut(self, v: Value | None) -> tuple[int, int, int] | None:
        return self.cuts.get(v.name) if v is not None and v.kind == "param" else None

    def _whole(self, v: Value) -> Value:
        """`v` as every rank's whole value: a value split along its last dim gathered."""
        dim = self.split.get(v.id)
        if dim is None:
            return v
        if dim != len(v.shape) - 1:
            raise NotImplementedError(f"tensor parallel: a value {v.type} split along dim {dim} would need a gather "
                                      "there, which the pass does not make")
        if v.id in self.ragged:
            raise NotImplementedError(f"tensor parallel over {self.world} ranks: a value {v.type} split unevenly "
                                      "(heads by whole KV groups) would need a gather, which the pass does not make; "
                                      "use a world size that divides the KV heads")
        return self.g.all_gather(v, world=self.world)

    def _set(self, node: Node, out: Value | tuple[Value, ...], dim: int | None, ins: list = ()) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        ragged = dim is not None and any(
            v is not None and (v.id in self.ragged or (v.kind == "param" and v.name in self.uneven)) for v in ins)
        for old, new in zip(node.outs, outs, strict=True):
            self.vmap[old.id] = new
            if dim is not None:
                self.split[new.id] = dim
            if ragged:
                self.ragged.add(new.id)

    def _node(self, node: Node) -> None:
        ins, op, attrs, g = [self._get(v) for v in node.inputs], node.op, dict(node.attrs), self.g
        if op == "embedding" and self._cut(node.inputs[0]) is not None:
            emb = g.embedding(ins[0], ins[1], **attrs, vocab_start=self._cut(node.inputs[0])[1])
            return self._set(node, g.all_reduce(emb), None)
        if op == "linear":
            x, w, b = (ins + [None])[:3]
            cut = self._cut(node.inputs[1])
            if cut is not None and cut[0] == 1:  # row-parallel: partial sums; the bias once, on rank 0
                if self.split.get(x.id) != len(x.shape) - 1:
                    raise NotImplementedError(f"tensor parallel: {node.inputs[1].name} is split by columns but its "
                                              f"input {x.type} is not split along its last dim")
                return self._set(node, g.all_reduce(g.linear(x, w, b if self.rank == 0 else None)), None)
            y = g.linear(self._whole(x), w, b)
            return self._set(node, y, len(y.shape) - 1 if cut is not None else None, [w])
        if op == "moe_experts":  # each expert split inside: its gate/up rows and down columns
            y = g.moe_experts(*(self._whole(v) for v in ins[:3]), *ins[3:], **attrs)
            split = any(self._cut(v) is not None for v in node.inputs[3:])
            return self._set(node, g.all_reduce(y) if split else y, None)
        if op == "reshape":
            return self._reshape(node, ins[0], attrs)
        if op in ("rms_norm", "layer_norm", "slice"):  # over the last dim: that dim must be whole
            x = ins[0]
            if self.split.get(x.id) == len(x.shape) - 1:
                x = self._whole(x)
            return self._set(node, g.op(op, x, *ins[1:], **attrs), self.split.get(x.id), [x])
        if OPS[op].kv_cache:  # heads split as q's (a latent, one head for all, is whole)
            return self._set(node, g.op(op, *ins, **attrs), self.split.get(ins[0].id), ins[:1])
        data = [i for i, v in enumerate(ins) if v is not None and v.kind != "param" and v.dtype != "i32"]
        dims = {self.split.get(ins[i].id) for i in data if not self._broadcasts(ins[i])}
        if len(dims) > 1:
            ins = [self._whole(v) if i in data else v for i, v in enumerate(ins)]
            dims = {None}
        return self._set(node, g.op(op, *ins, **attrs), dims.pop() if dims else None, [ins[i] for i in data])

    def _broadcasts(self, v: Value) -> bool:
        """A whole value of size 1 along another operand's split dim (one rope key for every head)."""
        return v.id not in self.split and any(d == 1 for d in v.shape[1:])

    def _reshape(self, node: Node, x: Value, attrs: dict) -> None:
        """A split value keeps its split on its first sized dim: [T, heads * d] <-> [T, heads, d]."""
        dim = self.split.get(x.id)
        old = node.inputs[0].shape
        first = [i for i, d in enumerate(old) if isinstance(d, int)]
        if dim is not None and dim != first[0]:
            x, dim = self._whole(x), None
        shape = list(attrs.pop("shape"))
        if dim is not None:
            local = prod(d for d in x.shape if isinstance(d, int))  # this rank's share, uneven ones too
            dim = next(i for i, d in enumerate(shape) if isinstance(d, int))
            rest = prod(d for i, d in enumerate(shape) if isinstance(d, int) and i != dim)
            if local % rest:
                raise NotImplementedError(f"tensor parallel: reshape of {x.type} to {tuple(shape)} splits a head")
            shape[dim] = local // rest
        self._set(node, self.g.reshape(x, shape=tuple(shape), **attrs), dim, [x])


# -- the rank's weights ----------------------------------------------------------------------------------------------

def cut_tensor(t: StoredTensor, axis: int, start: int, stop: int) -> StoredTensor:
    """Elements start:stop of `t` along `axis`. Quantized blocks lie along the last dim, so a cut across rows keeps
    them as they are, and one along the last dim on block boundaries too; any other is decoded to F32 first."""
    shape = list(t.shape)
    shape[axis] = stop - start
    if t.quantized:
        fmt, last = t.format, len(t.shape) - 1
        if axis < last or (start % fmt.block_elems == 0 and stop % fmt.block_elems == 0):
            data = np.ascontiguousarray(t.data).reshape(*t.shape[:-1], -1)
            if axis == last:
                data = data[..., start // fmt.block_elems * fmt.block_bytes:stop // fmt.block_elems * fmt.block_bytes]
            else:
                data = np.take(data, np.arange(start, stop), axis=axis)
            data = np.ascontiguousarray(data).reshape(prod(shape[:-1]), -1)
            return StoredTensor(data, t.kind, tuple(shape), t.source)
    e = t.as_elements()
    data = np.ascontiguousarray(np.take(e.data.reshape(t.shape), np.arange(start, stop), axis=axis))
    return StoredTensor(data, e.kind, tuple(shape), t.source)


class ShardedWeights(Mapping[str, StoredTensor]):
    """A rank's graph's parameters over the whole model's weight store, each cut on first use."""

    def __init__(self, graph: Graph, weights: Mapping[str, StoredTensor]):
        self._graph, self._weights = graph, weights

    def __getitem__(self, name: str) -> StoredTensor:
        t, cut = self._weights[name], self._graph.params[name].cut
        return t if cut is None else cut_tensor(t, *cut)

    def __iter__(self) -> Iterator[str]:
        return iter(self._graph.params)

    def __len__(self) -> int:
        return len(self._graph.params)
