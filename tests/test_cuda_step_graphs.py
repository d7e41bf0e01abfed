"""Steps with prefill tokens replayed as whole CUDA graphs (backends.cuda.step_graphs) give the eager steps' logits.

On CPU tensors each step runs eagerly on the graphs' static buffers (`capture=False`): the padding, the tile maps,
the chained tokens and the logits rows, with the mapped prefill kernel under Triton's interpreter. On a GPU
(tools/gpu_check.sh) the graphs are captured by the backend itself (LLM_ENGINE_WHOLE_STEPS, on by default).
"""

from __future__ import annotations

import importlib.util
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from kv_int8_models import tiny_model

from core.batch import make_batch
from tools.tiny_hf import random_prompt

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_keys_are_the_smallest_that_hold_a_step():
    from backends.cuda.step_graphs import StepKeys

    keys = StepKeys(320, 128)
    every = keys.all()
    assert len(set(every)) == len(every) and every[0] == (320, 128)
    assert keys.key(192, 65) == (192, 96) and keys.key(1, 1) == (8, 1) and keys.key(321, 1) is None
    assert keys.key(300, 129) is None  # more logits rows than sequences: not a step this engine makes
    assert keys.key(60, 60) == (64, 64)  # no more logits rows than the bucket's tokens
    for n, rows in itertools.product(range(1, 321, 7), range(1, 129, 3)):
        if rows <= n:
            assert keys.key(n, rows) == min(k for k in every if k[0] >= n and k[1] >= rows)
    assert StepKeys(8, 4).all() == [(8, 4), (8, 1)]


def test_no_whole_graphs_for_longrope():
    """A longrope table is picked per token by its sequence's length: metadata outside attention."""
    from backends.cuda.step_graphs import unavailable
    from ir.graph import Graph
    from ir.rope import longrope

    g = Graph("longrope")
    x = g.reshape(g.embedding(g.param("e", (10, 8)), g.input("token_ids", ("T",), "i32")), shape=("T", 2, 4))
    seq = g.input("context_lens", ("B",), "i32"), g.input("query_start", ("B+1",), "i32")
    g.output("x", g.rope(x, g.input("positions", ("T",), "i32"), *seq, spec=longrope(1e4, 4, [1, 1], [2, 2], 8, 1.0)))
    assert "longrope" in unavailable(SimpleNamespace(graph=g))


def _backends(model, device: str, max_tokens: int, monkeypatch, kv: str = "auto"):
    from backends.cuda.backend import WHOLE_STEPS_ENV, CUDABackend
    from backends.cuda.step_graphs import StepGraphs

    monkeypatch.setenv(WHOLE_STEPS_ENV, "1")
    whole, eager = (CUDABackend(model, device=device, dtype="f32", progress=False, cuda_graph=g, kv_cache_dtype=kv)
                    for g in (True, False))
    for b in (whole, eager):
        b.set_limits(4, 256, max_tokens)
        b.allocate_kv(48, 4)
    if device == "cpu":  # no graphs on CPU tensors: the same steps, run eagerly on the static buffers
        whole.whole = StepGraphs(whole.runner, whole._chain, max_tokens, 4, 48, capture=False)  # as allocate_kv
        whole.whole.capture_all()
    assert whole.whole is not None and eager.whole is None
    return whole, eager


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_whole_steps_match_eager_steps(device, tmp_path, monkeypatch):
    """Qwen2 with its second layer windowed (GQA, a sliding window, two KV groups: tables and slots of each)."""
    _check_steps(tiny_model("qwen2_swa", tmp_path), device, monkeypatch)


@needs_cuda
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_whole_steps_llama(kv, tmp_path, monkeypatch):
    """Llama (GQA, head dim 32), over a 16-bit cache and the int8 one (the mapped kernel's int8 twin)."""
    _check_steps(tiny_model("llama", tmp_path), "cuda", monkeypatch, kv)


@needs_cuda
def test_whole_steps_around_latent_attention(tmp_path, monkeypatch):
    """DeepSeek-V3's MLA: its prefill runs the mapped kernel as one KV head of the latent cache, its MoE inside."""
    from test_arch_deepseek import saved as deepseek

    _check_steps(deepseek("deepseek_v3", tmp_path)[1], "cuda", monkeypatch)


def _check_steps(model, device: str, monkeypatch, kv: str = "auto") -> None:
    """A prefill of two prompts, a mixed step (two decodes whose tokens the last step sampled on the device, and a
    third prompt's first chunk), then its second chunk beside the decodes: tokens and logits rows between buckets."""
    whole, eager = _backends(model, device, 32, monkeypatch, kv)
    g = whole.whole
    assert g.available and not g.failed and sorted(g.graphs) == [(8, 1), (8, 4), (16, 1), (16, 4), (32, 1), (32, 4)]
    tables = [list(range(i * 16, (i + 1) * 16))[::-1] for i in range(3)]
    a, b, c = (random_prompt(i, n, model.config.vocab_size) for i, n in ((1, 7), (2, 12), (3, 11)))
    groups = whole.kv_layout().num_groups

    def batch(chunks, cached, tabs):  # every KV group's pool holds the same block ids
        return make_batch(chunks, cached, tabs, 4, group_tables=[tabs] * (groups - 1))

    chained = batch([[-1], [-1], c[:6]], [7, 12, 0], tables)
    chained.prev_rows = np.array([1, 0] + [-1] * 6, np.int32)  # the decodes' tokens: the chain's rows 1 and 0
    steps = [batch([a, b], [0, 0], tables[:2]),  # 19 tokens, 2 logits rows: key (32, 4)
             chained,  # 8 tokens, 3 rows: (8, 4)
             batch([[7], [8], c[6:]], [8, 13, 6], tables)]  # 7 tokens
    before = [t.clone() for layer in whole.kv for t in layer]
    g._capture((32, 4))
    g._step((32, 4))  # what a capture's warm-up runs: padding only, owned by a sequence of context 0
    assert torch.isfinite(g.out[:4]).all()
    assert all(torch.equal(x, y) for x, y in zip(before, (t for layer in whole.kv for t in layer), strict=True))
    for be in (whole, eager):
        be._chain[:2] = torch.tensor([5, 6], dtype=torch.int32)
    whole.pieces = None  # on a GPU too: only the whole graphs or the eager path remain
    for step in steps:
        assert g.applies(step)
        got = whole.forward(step)
        assert got.data_ptr() == g.out.data_ptr()  # the whole graph's logits buffer: it served the step
        got, want = got.cpu().numpy().copy(), eager.forward(step).cpu().numpy()
        assert got.shape == want.shape == (len(step.logits_indices), model.config.vocab_size)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_failed_capture_is_logged_once_and_left_to_the_pieces(caplog):
    from backends.cuda.graphs import try_capture

    failed, calls = {}, []

    def capture(key):
        calls.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    what = "whole steps of %d tokens, %d logits rows (those steps run in pieces)"
    assert not try_capture(failed, (64, 8), capture, what) and not try_capture(failed, (64, 8), capture, what)
    assert calls == [(64, 8)] and "not permitted" in failed[(64, 8)]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "64 tokens, 8 logits rows" in warnings[0]


@needs_cuda
def test_engine_tokens_with_whole_steps(tmp_path, monkeypatch):
    """Through LLMEngine with overlapped steps, prompts arriving while others decode (mixed steps whose decodes'
    tokens are chained on the device): the same greedy tokens with whole-step graphs as with the pieces."""
    from backends.cuda.backend import WHOLE_STEPS_ENV, CUDABackend
    from backends.cuda.step_graphs import StepGraphs
    from core.sampling_params import SamplingParams
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    model = tiny_model("qwen2_swa", tmp_path)
    served = []
    real = StepGraphs.__call__

    def spy(self, batch):
        served.append(batch.prev_rows is not None and bool((batch.prev_rows >= 0).any()))
        return real(self, batch)

    monkeypatch.setattr(StepGraphs, "__call__", spy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (9, 30, 13, 5)]

    def tokens(whole: bool) -> dict:
        monkeypatch.setenv(WHOLE_STEPS_ENV, "1" if whole else "0")
        engine = LLMEngine(CUDABackend(model, dtype="f32", progress=False), EngineConfig(
            num_kv_blocks=96, block_size=8, async_scheduling=True,
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, prefill_chunk_size=24)))
        arrivals = {0: [0, 1], 3: [2], 5: [3]}
        out, step = {}, 0
        while step in arrivals or engine.has_unfinished():
            for i in arrivals.get(step, []):
                engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=10 - i, ignore_eos=True),
                                   str(i))
            out |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            step += 1
        return out

    want = tokens(False)
    assert not served
    assert tokens(True) == want and len(want) == 4
    assert len(served) >= 3 and sum(served) >= 2  # mixed steps with chained tokens went through the whole graphs
