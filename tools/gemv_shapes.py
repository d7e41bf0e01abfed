"""The GEMVs a decode step of a GGUF Llama-3-8B runs on CUDA, by file: llama.cpp's tensor types for its Q4_K_M,
Q5_K_M and Q8_0 files, through the fusion pass the backend runs (ir.fusion: q/k/v and gate/up concatenated where
their types agree), as (qtype, N, K) -> how many a step runs."""

from __future__ import annotations

from collections import Counter

from ir.fusion import fuse
from tools.bench_gpu_model import loaded_model, model_config, more_bits_layer

# file -> (the type of most matrices, the type of lm_head and of attn_v / ffn_down in llama.cpp's "use_more_bits"
# layers). Q8_0 keeps Q8_0 for the output matrix too (llama.cpp's Q6_K rule for it applies to the other types).
FILES = {"q4km": ("Q4_K", "Q6_K"), "q5km": ("Q5_K", "Q6_K"), "q8_0": ("Q8_0", "Q8_0")}


def tensor_type(file: str, name: str, layers: int) -> str:
    """The GGUF type llama-quantize gives a Llama matrix (our parameter names) in `file`."""
    base, more = FILES[file]
    parts = name.split(".")
    if name == "lm_head" or (parts[-1] in ("wv", "w_down") and more_bits_layer(int(parts[1]), layers)):
        return more
    return base


def step_gemvs(file: str, layers: int = 32) -> Counter:
    """(qtype, N, K) -> the GEMVs of that problem a Llama-3-8B decode step runs (batch rows aside)."""
    if file not in FILES:
        raise ValueError(f"unknown file {file!r} (known: {', '.join(FILES)})")
    graph = loaded_model(model_config(layers)).graph
    formats = {name: tensor_type(file, name, layers) for name, p in graph.params.items()
               if len(p.shape) == 2 and name != "embed"}  # the embedding is a row gather, no GEMV
    fused = fuse(graph, formats)
    out: Counter = Counter()
    for node in fused.nodes:
        w = node.inputs[1] if node.op == "linear" else None
        if w is None or w.kind != "param":
            continue
        p = fused.params[w.name]
        out[(formats[(p.parts or (w.name,))[0]], *p.shape)] += 1
    return out
