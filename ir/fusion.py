"""Fusion as an IR pass: a graph rewritten into the fused ops of `ir.ops`, each meaning exactly what it replaces.

Every backend lowers the pass's output (and the interpreter runs it, so fused and plain graphs are compared on the
same inputs); no pattern here is model-specific:

- linears: linears that read the same input with weights of one format (q/k/v, gate/up, phi's five) become one
  linear over a parameter whose `parts` are theirs, concatenated by rows, and a `slice` per part;
- gated: act(gate) * up, when the activation's only reader is that product;
- add_norm: a residual add whose sum feeds an rms_norm: `add_rms_norm`, both results;
- rope_attention: attention whose q and k come straight from two ropes of one spec, read by nothing else: k is
  rotated on its way into the cache (one kernel on CUDA);
- rope_pairs: two remaining ropes of one spec and positions (q and k) as one `rope_pair`.

A fused node reuses the values of the nodes it replaces, so their readers are untouched; only a fused linear's
concatenated output is a new value. Which parts may be concatenated is the caller's to say (`formats`: a Q4_K_M
file's q and k are Q4_K, its v Q6_K, so q and k fuse and v stays alone).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace

import numpy as np

from ir.graph import Graph, Node, Param, Value
from ir.ops import GATED_ACTS, TensorType


@dataclass(frozen=True)
class Fusions:
    """Which rewrites the pass makes (a backend or a benchmark's ablation turns one off)."""

    linears: bool = True
    gated: bool = True
    add_norm: bool = True
    rope_attention: bool = True
    rope_pairs: bool = True

    @classmethod
    def none(cls) -> Fusions:
        return cls(**{f.name: False for f in fields(cls)})


def fuse(graph: Graph, formats: Mapping[str, str] | None = None, fusions: Fusions = Fusions()) -> Graph:
    """A new graph with `fusions` applied; `formats` (parameter -> its format as the backend holds it) decides
    which weights may be concatenated: only parts of one format (all of them when None)."""
    g = _copy(graph, list(graph.nodes))
    if fusions.linears:
        _linears(g, formats or {})
    if fusions.gated:
        _gated(g)
    if fusions.add_norm:
        _add_norm(g)
    if fusions.rope_attention:
        _rope_attention(g)
    if fusions.rope_pairs:
        _rope_pairs(g)
    _keep_read_params(g)
    return g


def _copy(graph: Graph, nodes: list[Node]) -> Graph:
    g = Graph(graph.name, graph.dtype, dict(graph.inputs), dict(graph.params), nodes, dict(graph.outputs))
    g._param_values = dict(graph._param_values)
    g._next_id = graph._next_id
    return g


def _keep_read_params(g: Graph) -> None:
    read = {v.name for n in g.nodes for v in n.inputs if v is not None and v.kind == "param"}
    read |= {v.name for v in g.outputs.values() if v.kind == "param"}
    g.params = {k: p for k, p in g.params.items() if k in read}
    g._param_values = {k: v for k, v in g._param_values.items() if k in read}


def _outputs(g: Graph) -> set[int]:
    return {v.id for v in g.outputs.values()}


def _only_reader(g: Graph, uses: dict[int, list[Node]], value: Value, node: Node) -> bool:
    return value.id not in _outputs(g) and uses.get(value.id, []) == [node]


# -- linears ----------------------------------------------------------------------------------------------------

def _linears(g: Graph, formats: Mapping[str, str]) -> None:
    groups: dict[tuple, list[Node]] = defaultdict(list)
    for node in g.nodes:
        w = node.inputs[1] if node.op == "linear" else None
        if w is None or w.kind != "param":
            continue
        b = node.inputs[2] if len(node.inputs) > 2 else None
        if b is not None and b.kind != "param":
            continue
        key = (node.inputs[0].id, formats.get(w.name), b is not None, b is not None and formats.get(b.name))
        groups[key].append(node)
    fused: dict[int, list[Node]] = {}  # position of a group's first linear -> what replaces it
    dropped: set[int] = set()
    for nodes in groups.values():
        names = [n.inputs[1].name for n in nodes]
        if len(nodes) < 2 or len(set(names)) < len(names):
            continue
        fused[id(nodes[0])] = _fused_linear(g, nodes)
        dropped.update(id(n) for n in nodes[1:])
    out: list[Node] = []
    for node in g.nodes:
        if id(node) in fused:
            out += fused[id(node)]
        elif id(node) not in dropped:
            out.append(node)
    g.nodes = out


def _group_name(names: list[str]) -> str:
    prefix = names[0].rsplit(".", 1)[0] + "."
    if any(not n.startswith(prefix) for n in names):
        return "+".join(names)
    return prefix + "+".join(n[len(prefix):] for n in names)


def _concat_param(g: Graph, name: str, parts: list[Value]) -> Value:
    first = g.params[parts[0].name]
    shape = (sum(g.params[p.name].shape[0] for p in parts), *first.shape[1:])
    v = g.param(name, shape, first.dtype)
    g.params[name] = replace(g.params[name], parts=tuple(p.name for p in parts))
    return v


def _fused_linear(g: Graph, nodes: list[Node]) -> list[Node]:
    """One linear over the concatenated weight (and bias), then a slice per part giving that part's own value."""
    weights = [n.inputs[1] for n in nodes]
    name = _group_name([w.name for w in weights])
    w = _concat_param(g, name, weights)
    inputs = [nodes[0].inputs[0], w]
    if len(nodes[0].inputs) > 2 and nodes[0].inputs[2] is not None:
        biases = [n.inputs[2] for n in nodes]
        inputs.append(_concat_param(g, _group_name([b.name for b in biases]), biases))
    x = nodes[0].inputs[0]
    y = g._new_value(TensorType(x.shape[:-1] + (w.shape[0],), x.dtype), "node")
    out, start = [Node("linear", tuple(inputs), {}, (y,))], 0
    for n in nodes:
        size = int(n.inputs[1].shape[0])
        out.append(Node("slice", (y,), {"start": start, "size": size}, n.outs))
        start += size
    return out


# -- elementwise ------------------------------------------------------------------------------------------------

def _replace_each(g: Graph, rewrite) -> None:
    """Each node in order through rewrite(node, defined): None keeps it, (fused node, nodes it absorbs) puts the
    fused one in its place and drops those; `defined` holds the ids of the values computed before it."""
    defined = {v.id for v in g.inputs.values()}
    dropped: set[int] = set()
    out = []
    for node in g.nodes:
        hit = rewrite(node, defined)
        if hit is not None:
            node, absorbed = hit
            dropped.update(id(n) for n in absorbed)
        out.append(node)
        defined.update(v.id for v in node.outs)
    g.nodes = [n for n in out if id(n) not in dropped]


def _gated(g: Graph) -> None:
    uses, made = g.uses(), {n.out.id: n for n in g.nodes}

    def rewrite(node, defined):
        if node.op != "mul":
            return None
        for i in (0, 1):
            act, up = made.get(node.inputs[i].id), node.inputs[1 - i]
            if act is not None and act.op in GATED_ACTS and _only_reader(g, uses, act.out, node) \
                    and up.id != act.out.id and up.shape == act.out.shape:
                return Node("gated", (act.inputs[0], up), {"act": act.op}, node.outs), (act,)
        return None

    _replace_each(g, rewrite)


def _add_norm(g: Graph) -> None:
    uses = g.uses()

    def rewrite(node, defined):
        if node.op != "add":
            return None
        for norm in uses.get(node.out.id, []):
            w = norm.inputs[1] if norm.op == "rms_norm" else None
            if w is not None and norm.inputs[0].id == node.out.id and (w.kind == "param" or w.id in defined):
                attrs = {"eps": norm.attrs["eps"], "offset": norm.attrs.get("offset", 0.0)}
                return Node("add_rms_norm", (*node.inputs, w), attrs, (node.out, norm.out)), (norm,)
        return None

    _replace_each(g, rewrite)


# -- ropes ------------------------------------------------------------------------------------------------------

def _rope_key(node: Node) -> tuple:
    """What two ropes must share to be one kernel: spec, positions and (longrope) the sequences' lengths."""
    return (node.attrs["spec"], *(v.id if v is not None else None for v in node.inputs[1:]))


def _rope_attention(g: Graph) -> None:
    uses, made = g.uses(), {n.out.id: n for n in g.nodes}

    def rewrite(node, defined):
        if node.op != "attention":
            return None
        rq, rk = (made.get(v.id) for v in node.inputs[:2])
        ctx_q = node.inputs[5:7]
        if (rq is not None and rk is not None and rq.op == rk.op == "rope" and rq is not rk
                and _rope_key(rq) == _rope_key(rk) and _only_reader(g, uses, rq.out, node)
                and _only_reader(g, uses, rk.out, node)
                and all(a is None or a.id == b.id for a, b in zip(rq.inputs[2:4], ctx_q, strict=False))):
            inputs = (rq.inputs[0], rk.inputs[0], node.inputs[2], rq.inputs[1], *node.inputs[3:])
            return Node("rope_attention", inputs, {**node.attrs, "spec": rq.attrs["spec"]}, node.outs), (rq, rk)
        return None

    _replace_each(g, rewrite)


def _rope_pairs(g: Graph) -> None:
    uses = g.uses()
    at = {id(n): i for i, n in enumerate(g.nodes)}
    ropes = [n for n in g.nodes if n.op == "rope"]
    second: dict[int, Node] = {}  # id of a pair's later rope -> the pair
    dropped: set[int] = set()
    for i, a in enumerate(ropes):
        if id(a) in dropped or id(a) in second:
            continue
        for b in ropes[i + 1:]:
            if id(b) in dropped or id(b) in second or _rope_key(a) != _rope_key(b) or b.inputs[0].id == a.inputs[0].id:
                continue
            # The pair runs where the later rope stood: nothing may read the earlier one's result before that.
            if a.out.id in _outputs(g) or any(at[id(u)] < at[id(b)] for u in uses.get(a.out.id, [])):
                break
            second[id(b)] = Node("rope_pair", (a.inputs[0], b.inputs[0], *a.inputs[1:]), dict(a.attrs),
                                 (a.out, b.out))
            dropped.add(id(a))
            break
    g.nodes = [second.get(id(n), n) for n in g.nodes if id(n) not in dropped]


# -- weights of a fused graph -----------------------------------------------------------------------------------

def concat_parts(graph: Graph, params: Mapping[str, object], cat: Callable[[list], object]) -> dict[str, object]:
    """A backend's parameters for the fused `graph`: each fused parameter is `cat` of its parts as the backend holds
    them (which `fuse` saw as one format); parts nothing else reads are dropped."""
    out = {}
    for name, p in graph.params.items():
        out[name] = cat([params[part] for part in p.parts]) if p.parts else params[name]
    return out


class FusedWeights(Mapping[str, object]):
    """A fused graph's parameters over a weight store (the interpreter's view): a fused parameter's parts are
    decoded to fp32 and concatenated."""

    def __init__(self, graph: Graph, weights: Mapping[str, object]):
        self._graph, self._weights = graph, weights

    def __getitem__(self, name: str) -> object:
        p: Param = self._graph.params[name]
        if not p.parts:
            return self._weights[name]
        return np.concatenate([_dense(self._weights[n]) for n in p.parts], axis=0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._graph.params)

    def __len__(self) -> int:
        return len(self._graph.params)


def _dense(t: object) -> np.ndarray:
    return np.asarray(t.dequantize() if hasattr(t, "dequantize") else t, dtype=np.float32)
