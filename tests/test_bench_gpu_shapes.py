"""tools/bench_gpu's synthetic shapes (the GPU run is gpu_check's): each builds its architecture's graph at full
width from its checkpoint's config.json, with the real model's sizes."""

from __future__ import annotations

import pytest

from tools.bench_gpu import SHAPES, loaded_model, model_config

FULL = {"llama3-8b": ("llama", 32, 4096, 128, None), "gemma2-9b": ("gemma2", 42, 3584, 256, 4096),
        "phi3-mini": ("phi3", 32, 3072, 96, 2047)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_build_at_full_width(shape):
    arch, layers, hidden, head_dim, window = FULL[shape]
    cfg = model_config(None, shape)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.sliding_window) == \
        (arch, layers, hidden, head_dim, window)
    one = loaded_model(model_config(1, shape))
    assert one.arch.name == arch and one.config.num_layers == 1
    assert one.graph.params["embed"].shape == (cfg.vocab_size, hidden)
    assert sum(n.op == "attention" for n in one.graph.nodes) == 1
