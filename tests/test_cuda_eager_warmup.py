"""The CUDA backend's eager decode warm-up (graphs off): its steps cover every key the graphs would capture, and
write nothing into the KV cache. On CPU tensors (Triton's interpreter), a tiny synthetic llama."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                                reason="triton/torch not installed")


def test_eager_decode_warm_up_covers_graph_keys_and_writes_nothing():
    import torch

    from backends.cuda.backend import CUDABackend
    from backends.cuda.graphs import GraphKeys
    from backends.cuda.warm_batches import warm_up_eager_decode
    from ir.config import ModelConfig
    from ir.loader import synthetic_model
    from ir.rope import RopeSpec

    cfg = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                      head_dim=8, num_layers=1, rms_norm_eps=1e-5, max_position_embeddings=256,
                      rope=RopeSpec(theta=10000.0, rotary_dim=8))
    backend = CUDABackend(synthetic_model(cfg, "f32"), device="cpu", cuda_graph=False, random_weights=1,
                          progress=False)
    backend.set_limits(3, 160)
    backend.allocate_kv(12, 16)  # on CPU tensors allocate_kv warms nothing up: the test calls it
    for layer in backend.kv:
        for t in layer:
            t.normal_()
    before = [t.clone() for layer in backend.kv for t in layer]
    seen, forward = [], backend._forward

    def spy(batch, mirror=True):
        seen.append((batch.num_tokens, int(batch.context_lens.max()), batch.block_tables.shape[1]))
        logits = forward(batch, mirror)
        assert torch.isfinite(logits).all()
        return logits

    backend._forward = spy
    warm_up_eager_decode(backend, 160)
    after = [t for layer in backend.kv for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # slots -1: nothing written
    keys = GraphKeys(backend.runner, 3, 160)
    want = {(b, parts) for b, parts in keys.all()}
    got = {(rows, keys.parts(rows, ctx)) for rows, ctx, _ in seen}
    assert want <= got and {rows for rows, _, _ in seen} == set(keys.buckets) == {1, 2, 3}
    assert 1 in {w for _, _, w in seen}  # a table one block wide: Triton's integer class of its own
    assert all(1 <= ctx <= 160 and w == -(-ctx // 16) for _, ctx, w in seen)
