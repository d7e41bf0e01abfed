"""A readable text form of a graph: inputs, parameter table, then one line per node."""

from __future__ import annotations

from collections.abc import Mapping

from core.kv_layout import KVLayout
from ir.graph import Graph, Node


def _attr(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, tuple):
        return "(" + ",".join(str(x) for x in v) + ")"
    return str(v)


def format_node(node: Node) -> str:
    args = ", ".join(i.ref() if i is not None else "_" for i in node.inputs)
    attrs = " ".join(f"{k}={_attr(v)}" for k, v in node.attrs.items())
    attrs = f" {{{attrs}}}" if attrs else ""
    outs = ", ".join(f"%{v.id}" for v in node.outs)
    types = ", ".join(str(v.type) for v in node.outs)
    return f"  {outs} = {node.op}({args}){attrs} : {types}"


def format_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name} (compute {graph.dtype})"]
    for name, v in graph.inputs.items():
        lines.append(f"  input %{name} : {v.type}")
    lines += [format_node(n) for n in graph.nodes]
    for name, v in graph.outputs.items():
        lines.append(f"  output {name} = %{v.id} : {v.type}")
    return "\n".join(lines)


def format_params(graph: Graph, storage: Mapping[str, str] | None = None,
                  sources: Mapping[str, str] | None = None) -> str:
    """The parameter table; `storage` gives each parameter's stored type (e.g. Q4_1), `sources` the
    tensor name it was loaded from."""
    rows = [("param", "shape", "stored", "shard", "source")]
    total = 0
    for p in graph.params.values():
        n = 1
        for d in p.shape:
            n *= d
        total += n
        rows.append((p.name, "x".join(map(str, p.shape)), (storage or {}).get(p.name, p.dtype),
                     p.shard or "-", (sources or {}).get(p.name, "")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows]
    out.append(f"{len(graph.params)} parameters, {total:,} elements")
    return "\n".join(line.rstrip() for line in out)


def _ranges(ids: list[int]) -> str:
    """0-3,6,8-9"""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            a, b = ids[start], ids[i - 1]
            out.append(f"{a}" if a == b else f"{a}-{b}")
            start = i
    return ",".join(out)


def format_kv_layout(layout: KVLayout) -> str:
    """What the paged cache holds per token: one line per KV group and cache shape (a latent layer's one tensor, its
    values the keys' first value_dim; or keys and values)."""
    lines = []
    for g, grp in enumerate(layout.groups):
        by_shape: dict = {}
        for i in grp.layers:
            by_shape.setdefault(layout.shapes[i], []).append(i)
        for s, layers in by_shape.items():
            what = (f"latent {s.heads}x{s.key_dim} (values: its first {s.value_dim})" if s.values_in_keys else
                    f"k {s.heads}x{s.key_dim} + v {s.heads}x{s.value_dim}")
            where = "full" if grp.window is None else f"window {grp.window}"
            lines.append(f"kv cache group {g} ({where}) layers {_ranges(layers)}: {what} = {s.elements} elements a "
                         "token and layer")
    return "\n".join(lines)
