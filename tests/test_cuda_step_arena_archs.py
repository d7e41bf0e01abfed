"""The eager step's kept buffers and repeated launches (backends/cuda/step_arena.py, on with CUDA graphs off) on the
architectures whose steps differ from the tiny llama of tests/test_cuda_step_arena.py: gemma3 (a local and a global
KV group, sliding windows, q/k norms, a rope of its own per layer type), phi3 with longrope (its rope rows are not
the positions: the attention is not replayed) and qwen3_moe (a dense layer, then routed experts). Greedy decoding
through the CUDA backend on CPU tensors (Triton's interpreter) with the arena (every kept buffer NaN before each
step; three sequences, so its decode steps run padded to a batch bucket of 4) gives the tokens and the logits of the
same backend without it (three rows), bit for bit."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")

NEW = 5


def _gemma3(tmp_path):
    import test_arch_gemma as g

    return g.make_hf("gemma3"), g.prompt(4, 2 * g.WINDOW + 3)


def _phi3(tmp_path):
    import test_arch_phi as p

    return p.make_hf("phi3_longrope"), p.prompt(4, p.ORIGINAL - 3)  # crosses to the long factors while decoding


def _qwen3_moe(tmp_path):
    from test_arch_moe import CASES

    from tools.check_arch import hf_config
    from tools.tiny_hf import random_causal_lm, random_prompt

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CASES["qwen3_moe"]))
    model = random_causal_lm(hf_config(str(path), 2), 0)
    return model, random_prompt(4, 9, model.config.vocab_size)


BUILDERS = {"gemma3": _gemma3, "phi3_longrope": _phi3, "qwen3_moe": _qwen3_moe}


def _greedy(loaded, prompts, arena: bool):
    """(tokens per prompt, every step's logits) of NEW greedy steps of the prompts together, and the arena."""
    from backend_greedy import backend_greedy

    from backends.cuda import eager
    from backends.cuda.backend import CUDABackend
    from backends.cuda.step_arena import StepArena
    from ir.reference import ReferenceRunner

    ref = ReferenceRunner(loaded, max_tokens=64, block_size=4)
    backend = CUDABackend(loaded, device="cpu", progress=False, dtype="f32", cuda_graph=False)
    if arena:  # what a GPU's backend with graphs off sets (CPU tensors keep them off)
        eager.use_eager_fusions(backend.runner)
        backend.runner.arena = StepArena(backend.runner.graph, check=True)
    steps: list = []
    outs, _ = backend_greedy(backend, ref, prompts, NEW, 4, steps)
    return outs, steps, backend.runner.arena


@pytest.mark.parametrize("case", list(BUILDERS))
def test_kept_buffers_on_each_architecture(case, tmp_path):
    from ir.loader import load_model

    hf, prompt = BUILDERS[case](tmp_path)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf", progress=False)
    prompts = [prompt, prompt[:5], prompt[:7]]  # 3 rows: with the arena, decode steps padded to 4 (eager.padded_rows)
    want, want_logits, _ = _greedy(loaded, prompts, arena=False)
    got, got_logits, arena = _greedy(loaded, prompts, arena=True)
    assert got == want
    for g, w in zip(got_logits, want_logits, strict=True):
        np.testing.assert_array_equal(g, w)
    assert arena._buffers and arena.memo, "the decode steps kept nothing: the test would prove little"
    assert arena.rows == 4  # the 3-row decode steps ran padded
    from backends.cuda.attention import _Launches

    replayed = any(isinstance(v, _Launches) for v in arena.memo.values())
    assert replayed == (case != "phi3_longrope")  # longrope's rope rows are not the positions: never replayed
