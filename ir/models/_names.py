"""What most architectures' weight transforms share: parameters bound one to one by a name map, and llama.cpp's
q/k row permutation undone."""

from __future__ import annotations

from collections.abc import Mapping

from ir.graph import Graph
from ir.weights import StoredTensor, WeightSource, rope_unpermute_rows


def layer_names(table: Mapping[str, tuple[str, str]], top: Mapping[str, tuple[str, str]], num_layers: int,
                fmt: str) -> dict[str, str]:
    """IR parameter -> the file's tensor name, from (HF name, GGUF name) tables; "{i}" is the layer index."""
    which = 0 if fmt == "hf" else 1
    out = {k: v[which] for k, v in top.items()}
    for i in range(num_layers):
        out.update({f"layers.{i}.{k}": v[which].format(i=i) for k, v in table.items()})
    return out


def bind(graph: Graph, src: WeightSource, names: Mapping[str, str]) -> dict[str, StoredTensor]:
    """Every parameter of the graph from the tensor its name maps to (a parameter missing from the map is looked
    up under its own name)."""
    return {p: src.require(names.get(p, p), p) for p in graph.params}


def unpermute_qk(weights: dict[str, StoredTensor], num_layers: int, heads: int, kv_heads: int) -> None:
    """llama.cpp's converter permutes q/k rows (weights and biases) of llama-like models for ggml's interleaved
    rope; undo it in place, giving back HF's neox layout (rows of raw blocks move whole: no requantization)."""
    for i in range(num_layers):
        for key, n in (("wq", heads), ("bq", heads), ("wk", kv_heads), ("bk", kv_heads)):
            name = f"layers.{i}.{key}"
            if name in weights:
                t = weights[name]
                weights[name] = t.permute_rows(rope_unpermute_rows(t.shape[0], n))
