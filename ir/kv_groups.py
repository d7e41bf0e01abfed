"""A graph's KV layout (`core.kv_layout`), read off its attention nodes (Graph.attention_nodes: every op that writes
a layer's paged cache and attends over it, with the attributes layer, scale, sliding_window and softcap): an
attention's q, k, v are its first three operands; a latent_attention's q and latent its first two, the values being
the latent's first value_dim elements."""

from __future__ import annotations

from core.kv_layout import KVLayout, LayerCache
from ir.graph import Graph, Node


def layer_cache(node: Node) -> LayerCache:
    """What one attention node caches per token."""
    k = node.inputs[1]
    if node.op == "latent_attention":
        return LayerCache(k.shape[1], k.shape[2], node.attrs["value_dim"], values_in_keys=True)
    return LayerCache(k.shape[1], k.shape[2], node.inputs[2].shape[2])


def kv_layout(graph: Graph) -> KVLayout:
    """Each attention layer's KV group (by its sliding window) and cache shape."""
    nodes = graph.attention_nodes()
    layers = [n.attrs["layer"] for n in nodes]
    if layers != list(range(len(nodes))):
        raise ValueError(f"attention layers must be numbered 0..{len(nodes) - 1} in graph order, not {layers}")
    return KVLayout.from_layers([n.attrs.get("sliding_window") or None for n in nodes], [layer_cache(n) for n in nodes])
