"""Steps with prefill tokens replayed in pieces (backends.cuda.piecewise) give the eager steps' logits.

On CPU tensors the pieces run eagerly on their static buffers (`capture=False`): the bookkeeping of which values
are held, padded and sliced, with the DSL's kernels under Triton's interpreter. On a GPU (tools/gpu_check.sh) the
pieces are CUDA graphs, captured by the backend itself.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from test_tiny_models import saved  # noqa: F401  (saved is a fixture)

from backends.cuda.warm_batches import warm_up_attention, warm_up_eager_steps
from core.batch import make_batch
from ir.loader import load_model
from tools.tiny_hf import random_prompt

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _backends(model, device: str, max_tokens: int):
    from backends.cuda.backend import CUDABackend
    from backends.cuda.piecewise import PiecewiseGraphs

    pieced, eager = (CUDABackend(model, device=device, dtype="f32", progress=False, cuda_graph=g)
                     for g in (True, False))
    for b in (pieced, eager):
        b.set_limits(4, 256, max_tokens)
        b.allocate_kv(48, 4)
    if device == "cpu":  # no graphs on CPU tensors: the same pieces, run eagerly
        pieced.pieces = PiecewiseGraphs(pieced.runner, max_tokens, capture=False)
        pieced.pieces.capture_all()
    return pieced, eager


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["llama3_rope", "mistral_window"])
def test_pieces_match_eager_steps(case, device, saved):  # noqa: F811
    """A prefill of two prompts, then a mixed step (two decodes and a third prompt's first chunk), then its second
    chunk with the decodes: token counts between buckets, so every step runs on padding rows too."""
    _check_steps(load_model(saved(case)[1], progress=False), device)


@needs_cuda
def test_pieces_around_latent_attention(tmp_path):
    """DeepSeek-V3's MLA (latent_attention, one cache tensor a layer) between pieces, its MoE inside them (on the
    GPU only: on CPU tensors its interpreted MoE kernels take half a minute; the llama cases check the bookkeeping)."""
    from test_arch_deepseek import saved as deepseek

    _check_steps(deepseek("deepseek_v3", tmp_path)[1], "cuda")


def _check_steps(model, device: str) -> None:
    pieced, eager = _backends(model, device, 32)
    assert pieced.pieces is not None and sorted(pieced.pieces.captured) == [8, 16, 32]
    tables = [list(range(i * 16, (i + 1) * 16))[::-1] for i in range(3)]
    a, b, c = (random_prompt(i, n, model.config.vocab_size) for i, n in ((1, 7), (2, 12), (3, 11)))
    steps = [make_batch([a, b], [0, 0], tables[:2], 4),  # 19 tokens: the 32 bucket
             make_batch([[5], [6], c[:6]], [7, 12, 0], tables, 4),  # 8 tokens
             make_batch([[7], [8], c[6:]], [8, 13, 6], tables, 4)]  # 7 tokens
    for step in steps:
        got, want = (be.forward(step).cpu().numpy() for be in (pieced, eager))
        assert got.shape == want.shape == (len(step.logits_indices), model.config.vocab_size)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_plan_cuts_at_attention_and_keeps_the_logits_tail_eager(saved):  # noqa: F811
    from backends.cuda.piecewise import plan
    from ir.fusion import Fusions, fuse

    model = load_model(saved("llama3_rope")[1], progress=False)
    p = plan(fuse(model.graph, {}, Fusions()))
    kinds = [k for k, _ in p.steps]
    layers = model.config.num_layers
    assert kinds == ["graph", "attention"] * layers + ["graph"]
    assert p.tail and p.tail[0].op == "gather_rows"  # the rows that need logits: a count that varies
    attention = [n for k, nodes in p.steps if k == "attention" for n in nodes]
    assert all(v.id in p.attention_reads for n in attention for v in n.inputs if v.kind != "param")


def test_plan_refuses_a_longrope_graph():
    """A longrope table is picked per token by its sequence's length, which a piece cannot read."""
    from backends.cuda.piecewise import plan
    from ir.graph import Graph
    from ir.rope import longrope

    g = Graph("longrope")
    x = g.reshape(g.embedding(g.param("e", (10, 8)), g.input("token_ids", ("T",), "i32")), shape=("T", 2, 4))
    seq = g.input("context_lens", ("B",), "i32"), g.input("query_start", ("B+1",), "i32")
    g.output("x", g.rope(x, g.input("positions", ("T",), "i32"), *seq, spec=longrope(1e4, 4, [1, 1], [2, 2], 8, 1.0)))
    assert "longrope" in plan(g)


def test_attention_warm_up_writes_nothing(saved, caplog):  # noqa: F811
    """The start-up steps that compile the eager attention for each table width (warm_batches.warm_up_attention) run
    through the pieces, leave the KV cache as it was (their slots are -1) and are not sent to workers again."""
    model = load_model(saved("llama3_rope")[1], progress=False)
    pieced, _ = _backends(model, "cpu", 32)
    before = [t.clone() for layer in pieced.kv for t in layer]
    sent = []
    pieced.mirror = lambda *call, **kw: sent.append(call[0])  # each rank warms up inside the mirrored allocate_kv
    warm_up_attention(pieced, 4)
    assert not [r for r in caplog.records if r.levelname == "WARNING"] and sent == []
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in pieced.kv for t in layer), strict=True))


@pytest.mark.parametrize("case", ["llama3_rope", "mistral_window"])
def test_eager_step_warm_up_writes_nothing_and_mirrors_nothing(case, saved, caplog):  # noqa: F811
    """The start-up steps past the graphs' tokens (warm_batches.warm_up_eager_steps: decode rows beside a prompt, 3
    and 16 sequences) run, leave the KV cache as it was, and are not sent to tensor-parallel workers again (each
    rank runs its own inside the mirrored allocate_kv)."""
    from backends.cuda.warm_batches import mixed_batch

    batch = mixed_batch(16, 61, 4, 32, groups=2)  # what a step of 61 tokens over 16 sequences looks like
    q = np.diff(batch.query_start)
    assert batch.num_tokens == 61 and list(q) == [1] * 15 + [46] and (batch.context_lens >= q).all()
    assert batch.block_tables.shape[1] * 4 >= batch.context_lens.max() and (batch.slot_mapping == -1).all()
    assert batch.positions.max() < 32 and len(batch.group_tables) == 1
    model = load_model(saved(case)[1], progress=False)
    pieced, _ = _backends(model, "cpu", 32)
    pieced.max_step_tokens = 61
    before = [t.clone() for layer in pieced.kv for t in layer]
    sent = []
    pieced.mirror = lambda *call, **kw: sent.append(call[0])
    warm_up_eager_steps(pieced, 32)
    assert not [r for r in caplog.records if r.levelname == "WARNING"] and sent == []
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in pieced.kv for t in layer), strict=True))
