"""With CUDA graphs on, decode steps replay graphs and prefill steps up to the pieces' tokens replay them too, but a
prefill step past them launches eagerly: after warm_up_eager_steps and warm_up_graph_prefill, no such step (several
sequences, each a whole prompt, a chunk of one, or a decode row) launches a kernel variant that Triton would compile
then, on a tiny llama and a tiny Qwen3-MoE. An H200 saw a 4,096-token step of 64 prompts take 0.90 s to launch.

On CPU tensors (Triton's interpreter) with graphs off, the eager path the graphs leave, past a small piece limit
(FIRST tokens). The start-up recorded is less than a GPU's (no graph captures, no warm_up_attention through the
pieces), so what the steps then need the two warm-ups must build themselves. Variants as
test_cuda_eager_warmup records them (the kernel, constexprs, warps/PDL/stages, direct_key of the arguments).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_eager_warmup import BLOCK, CONTEXT, SEQS, Variants, pytestmark, tiny_backend  # noqa: F401

FIRST, STEP_TOKENS = 64, 128  # the pieces' most tokens (512 on a GPU; the MoE's tiles change past 64), the most a step


def tiny_moe(monkeypatch):
    """tiny_backend's llama with a Qwen3-MoE block: 3 experts, 2 a token (moe.default_tiles' taller tiles from 192
    slots: 96 tokens, inside the eager range and off its power-of-two buckets' ends)."""
    from backends.cuda.backend import CUDABackend
    from ir.loader import synthetic_model
    from ir.models.moe import MoEConfig
    from ir.rope import RopeSpec

    cfg = MoEConfig(arch="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=64, num_heads=2,
                    num_kv_heads=1, head_dim=16, num_layers=1, rms_norm_eps=1e-5, max_position_embeddings=CONTEXT,
                    rope=RopeSpec(theta=10000.0, rotary_dim=16), num_experts=3, top_k=2, moe_intermediate_size=32)
    backend = CUDABackend(synthetic_model(cfg, "f16"), dtype="f16", device="cpu", cuda_graph=False,
                          random_weights=1, progress=False)
    backend.set_limits(SEQS, CONTEXT, STEP_TOKENS)
    backend.allocate_kv(SEQS * (CONTEXT // BLOCK + 1) + 1, BLOCK)
    return backend


def routed(monkeypatch) -> None:
    """Experts chosen from unset memory (the router's launch skipped) clamped into range: the steps still run."""
    from kernels_src import moe_route

    router = moe_route.moe_route

    def route(logits, *args, **kw):
        weights, ids = router(logits, *args, **kw)
        return weights, ids.clamp_(0, logits.shape[-1] - 1)

    monkeypatch.setattr(moe_route, "moe_route", route)


def step(backend, rng, rows: int, prompts, starts):
    """`rows` decode rows (contexts up to CONTEXT) beside prompts of `prompts` tokens from `starts` (0: whole, else a
    chunk), as the engine batches them (core.batch.make_batch: each sequence its own shuffled blocks, its table as
    long as its blocks)."""
    from core.batch import make_batch

    contexts = rng.integers(2, CONTEXT, rows).tolist()
    cached = [c - 1 for c in contexts] + list(starts)
    lens = [1] * rows + list(prompts)
    free, tables, at = rng.permutation(backend.kv[0][0].shape[0] - 1) + 1, [], 0  # block 0 is the warm-ups'
    for c, n in zip(cached, lens, strict=True):
        blocks = -(-(c + n) // BLOCK)
        tables.append(free[at:at + blocks].tolist())
        at += blocks
    return make_batch([rng.integers(0, 61, n).tolist() for n in lens], cached, tables, BLOCK)


def random_step(backend, rng):
    """A step of FIRST+1..STEP_TOKENS tokens: decode rows and 1..SEQS prompts, whole or chunks."""
    tokens = int(rng.integers(FIRST + 1, STEP_TOKENS + 1))
    seqs = int(rng.integers(1, SEQS + 1))
    rows = int(rng.integers(0, seqs))  # at least one prompt
    n = seqs - rows
    cuts = sorted(rng.choice(np.arange(1, tokens - rows), min(n, tokens - rows) - 1, replace=False))
    prompts = np.diff([0, *cuts, tokens - rows]).tolist()
    starts = [int(rng.integers(0, CONTEXT - p)) if rng.random() < 0.5 else 0 for p in prompts]
    return step(backend, rng, rows, prompts, starts)


# the start-up's launches that do not run leave their outputs unset: the interpreter warns of the NaNs after them
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_no_eager_prefill_step_compiles_after_the_graph_warm_ups(model, monkeypatch):
    import torch

    from backends.cuda.warm_batches import graph_prefill_steps, warm_up_eager_steps, warm_up_graph_prefill

    backend = tiny_backend(monkeypatch) if model == "llama" else tiny_moe(monkeypatch)
    backend.max_step_tokens = STEP_TOKENS
    for layer in backend.kv:
        for t in layer:
            t.normal_()
    before = [t.clone() for layer in backend.kv for t in layer]
    routed(monkeypatch)
    variants = Variants(monkeypatch)
    variants.run = "new"
    warm_up_eager_steps(backend, CONTEXT)
    warm_up_graph_prefill(backend, CONTEXT, FIRST)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in backend.kv for t in layer), strict=True))
    experts = (3, 2) if model == "qwen3_moe" else ()
    assert len(graph_prefill_steps(FIRST, STEP_TOKENS, SEQS, BLOCK, *experts)) <= 20  # start-up steps
    # the prefill attention by its table stride's class (argument 14): a multiple of 16 only, an eager step's tables
    # padded to step_meta.TABLE_BUCKET blocks (the run below has tables of 1 to 9 blocks)
    prefill = [v for v in variants.seen if v.kernel == "kernels_src.paged_prefill.paged_prefill_kernel"]
    assert {v.args[14] for v in prefill} == {16}

    rng = np.random.default_rng(0)
    variants.run = "all"
    # run: 72 tokens of 9 prompts (a table of 1 block), 3 chunks beside 5 decode rows, 18 sequences
    for rows, prompts, starts in ((0, [8] * 9, [0] * 9), (5, [40, 27, 3], [100, 0, 7]), (10, [9] * 8, [0, 40] * 4)):
        variants.step = (rows, tuple(prompts), tuple(starts))
        logits = backend._forward(step(backend, rng, rows, prompts, starts), mirror=False)
        assert logits.shape == (rows + len(prompts), 61) and torch.isfinite(logits).all()
    assert variants.new() == [], [(s, v.kernel, v.constexprs, v.args) for s, v in variants.new()]
    variants.run = "none"  # a sweep: the steps' host work only
    for i in range(300):
        variants.step = i
        backend._forward(random_step(backend, rng), mirror=False)
    assert variants.new() == [], [(s, v.kernel, v.constexprs, v.args) for s, v in variants.new()]
