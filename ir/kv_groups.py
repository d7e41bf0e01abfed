"""The attention layers of a graph and their KV layout (`core.kv_layout`), read off its attention nodes.

Every op that writes a layer's paged cache and attends over it takes q, k, v as its first three operands and the
attributes layer, scale, sliding_window and softcap; `ATTENTION_OPS` names them, so that code needing "the attention
layers" asks here instead of matching op names itself.
"""

from __future__ import annotations

from core.kv_layout import KVLayout
from ir.graph import Graph, Node

ATTENTION_OPS = frozenset({"attention", "rope_attention"})  # rope_attention: q and k rotated in the same op


def attention_nodes(graph: Graph) -> list[Node]:
    """The graph's attention nodes, in layer order (checked: layer i is the i-th)."""
    nodes = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    layers = [n.attrs["layer"] for n in nodes]
    if layers != list(range(len(nodes))):
        raise ValueError(f"attention layers must be numbered 0..{len(nodes) - 1} in graph order, not {layers}")
    return nodes


def kv_layout(graph: Graph) -> KVLayout:
    """Each attention layer's KV group (by its sliding window) and cache shape."""
    nodes = attention_nodes(graph)
    shapes = [(n.inputs[1].shape[1], n.inputs[1].shape[2], n.inputs[2].shape[2]) for n in nodes]
    return KVLayout.from_layers([n.attrs.get("sliding_window") or None for n in nodes], shapes)
