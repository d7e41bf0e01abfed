"""A graph's KV layout (`core.kv_layout`), read off its attention nodes (Graph.attention_nodes: every op that writes
a layer's paged cache and attends over it, with q, k, v as its first three operands and the attributes layer,
scale, sliding_window and softcap)."""

from __future__ import annotations

from core.kv_layout import KVLayout
from ir.graph import Graph


def kv_layout(graph: Graph) -> KVLayout:
    """Each attention layer's KV group (by its sliding window) and cache shape."""
    nodes = graph.attention_nodes()
    layers = [n.attrs["layer"] for n in nodes]
    if layers != list(range(len(nodes))):
        raise ValueError(f"attention layers must be numbered 0..{len(nodes) - 1} in graph order, not {layers}")
    shapes = [(n.inputs[1].shape[1], n.inputs[1].shape[2], n.inputs[2].shape[2]) for n in nodes]
    return KVLayout.from_layers([n.attrs.get("sliding_window") or None for n in nodes], shapes)
