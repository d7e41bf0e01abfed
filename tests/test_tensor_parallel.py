"""Tensor parallel over processes on CPU tensors: rank 0 here, ranks 1.. spawned (backends.cuda.tensor_parallel),
gloo between them, the DSL's kernels on Triton's interpreter. Tiny llama, qwen3, windowed mistral and qwen2_moe
(routed experts split inside each expert, a gated shared expert, a dense layer) models over 2 processes, and llama
over 4 (KV heads replicated), give the greedy tokens of one process and first-step logits within 1e-5 of
max|logit| (fp32). A worker killed in the middle of a request: test_tensor_parallel_server."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from backend_greedy import backend_greedy
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)
from tiny_hf import assert_close

from ir.loader import load_model
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")

TP_TOL = 1e-5  # of max|logit|: sums over ranks in another order; a wrong shard moves logits by whole units
NEW = 2  # a prefill of both prompts, then a decode step over their cached tokens


def greedy(backend, model, prompts, new: int):
    return backend_greedy(backend, ReferenceRunner(model, max_tokens=48, block_size=4), prompts, new, 4)


def start(model, world: int):
    from backends.cuda import tensor_parallel

    return tensor_parallel.start(model, ["cpu"] * world, dtype="f32", progress=False)


@pytest.mark.parametrize("case, world", [("llama3_rope", 2), ("qwen3", 2), ("mistral_window", 2), ("qwen2_moe", 2),
                                         ("llama3_rope", 4)])
def test_processes_match_one(case, world, saved):  # noqa: F811
    """Against the one-process reference (test_cuda_backend holds one process of this backend to it within 1e-4;
    here the ranks' backends, on the same kernels, are held to 1e-5)."""
    model = load_model(saved(case)[1], progress=False)
    prompts, new = [prompt(1), prompt(2, 9)], NEW
    tokens, first = ReferenceRunner(model, max_tokens=48, block_size=4).greedy(prompts, new)
    backend = start(model, world)
    try:
        assert backend.kv_layout().shapes[0].heads == max(1, 2 // world)  # the rank's share of the KV heads
        if case == "qwen2_moe":  # every rank holds all 8 experts, each its share of the 32 rows
            assert backend.rank_graph.params["layers.1.exp_gate"].shape == (8, 32 // world, 64)
        tp_tokens, tp_first = greedy(backend, model, prompts, new)
    finally:
        backend.workers.close()
    assert tp_tokens == tokens
    assert_close(tp_first, first, TP_TOL)


def test_heads_that_do_not_split_are_refused_before_any_process_starts(saved):  # noqa: F811
    model = load_model(saved("qwen3")[1], progress=False)
    with pytest.raises(ValueError, match=r"layers.0.wq \[64, 64\] has 4 heads"):
        start(model, 8)
    with pytest.raises(ValueError, match="power of two"):
        start(model, 3)
    np.testing.assert_equal(torch.distributed.is_initialized(), False)
