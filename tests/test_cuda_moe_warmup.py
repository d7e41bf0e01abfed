"""A MoE whose top_k is not a power of two (DeepSeek-V2's 6): after the start-up warm-ups, no step of any token count
launches a MoE kernel variant they did not build. The slot count S (tokens x top_k) picks the MoE's kernels and
constexprs (kernels_src/moe.py slot_bounds: the GEMV or the grouped kernels, their tiles, moe_align's kernel or its
array ops, the int8 GEMV) and the integer class of moe_align's block count, an argument (moe.slot_key); at top 6 the
bounds fall inside the warm-up's power-of-two token buckets, reached only where other counts happened to share the
variants. Before slot_key the block count's class was missed (the graphs-on case below, 65 tokens; Qwen3-30B-A3B's
17 tokens eager: the second test).

The first test: on CPU tensors (Triton's interpreter), a tiny Qwen3-MoE of 16 experts, 6 a token, up to 192 tokens a
step: slot bounds at 17 (the dense GEMV's experts), 33 (BLOCK_N 16 -> 32), 64-65 (the int8 GEMV's, moe_dequant's, the
GGUF GEMV's), 257 (BLOCK_N 32 -> 64), 1,024 (taller blocks) and 1,025 (moe_align's kernel). Variants as
test_cuda_eager_warmup records them (the kernel, constexprs, warps/PDL/stages, direct_key of the arguments), none
run: the warm-ups' and the sweeps' host work only. The second: moe.moe_experts alone at real expert counts.
"""

from __future__ import annotations

import pytest
from test_cuda_eager_warmup import BLOCK, CONTEXT, SEQS, Variants, pytestmark  # noqa: F401
from test_cuda_graph_prefill_warmup import routed

EXPERTS, TOP_K, STEP_TOKENS, FIRST = 16, 6, 192, 64


def tiny_deepseek_like(monkeypatch):
    """A one-layer Qwen3-MoE of EXPERTS experts, TOP_K a token (DeepSeek-V2-Lite's top 6), graphs off."""
    from backends.cuda.backend import CUDABackend
    from ir.loader import synthetic_model
    from ir.models.moe import MoEConfig
    from ir.rope import RopeSpec

    cfg = MoEConfig(arch="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=64, num_heads=2,
                    num_kv_heads=1, head_dim=16, num_layers=1, rms_norm_eps=1e-5, max_position_embeddings=CONTEXT,
                    rope=RopeSpec(theta=10000.0, rotary_dim=16), num_experts=EXPERTS, top_k=TOP_K,
                    moe_intermediate_size=32)
    backend = CUDABackend(synthetic_model(cfg, "f16"), dtype="f16", device="cpu", cuda_graph=False,
                          random_weights=1, progress=False)
    backend.set_limits(SEQS, CONTEXT, STEP_TOKENS)
    backend.allocate_kv(SEQS * (CONTEXT // BLOCK + 1) + 1, BLOCK)
    return backend


def prompt(tokens: int, groups: int):
    """One whole prompt of `tokens` tokens that writes nothing: a MoE's kernels see only the step's token count."""
    import numpy as np

    from backends.cuda.warm_batches import one_sequence

    width = -(-tokens // BLOCK)
    return one_sequence(np.zeros(tokens, np.int32), np.arange(tokens, dtype=np.int32), np.full(tokens, -1, np.int32),
                        np.arange(1, width + 1, dtype=np.int32)[None], groups)


def moe_misses(variants: Variants) -> list:
    return [(step, v.kernel, v.constexprs, v.args) for step, v in variants.new() if ".moe" in v.kernel]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs-on"])
def test_no_moe_step_compiles_after_the_warm_ups(monkeypatch, graphs):
    """Graphs off: the eager decode and prefill warm-ups, then every token count 1..STEP_TOKENS. Graphs on: the steps
    past the pieces (FIRST tokens) launch eagerly, after warm_up_eager_steps and warm_up_graph_prefill."""
    from backends.cuda.warm_batches import (
        warm_up_eager_decode,
        warm_up_eager_prefill,
        warm_up_eager_steps,
        warm_up_graph_prefill,
    )

    backend = tiny_deepseek_like(monkeypatch)
    routed(monkeypatch)
    variants = Variants(monkeypatch)
    variants.run = "none"  # the launches recorded, none run: steps of unset memory, their host work only
    if graphs:
        warm_up_eager_steps(backend, CONTEXT)
        warm_up_graph_prefill(backend, CONTEXT, FIRST)
    else:
        warm_up_eager_decode(backend, CONTEXT)
        warm_up_eager_prefill(backend, CONTEXT)
    assert any(".moe_gemv" in v.kernel for v in variants.seen) != graphs  # both paths where steps take them
    assert any(v.kernel == "kernels_src.moe.moe_gemm_kernel" for v in variants.seen)
    groups = backend.kv_layout().num_groups
    for tokens in range(FIRST + 1 if graphs else 1, STEP_TOKENS + 1):
        variants.step = tokens
        backend._forward(prompt(tokens, groups), mirror=False)
    assert moe_misses(variants) == []


def stacks(experts: int, gguf: bool):
    """Expert stacks of `experts` experts, 256 x 256 (whole Q4_K super-blocks), zeros: nothing runs."""
    import torch

    from ir.formats.gguf_quants import row_bytes
    from kernels_src.moe_gguf import GGUFStack

    if not gguf:
        return [torch.zeros(experts, 256, 256, dtype=torch.float16) for _ in range(3)]
    return [GGUFStack(torch.zeros(experts * 256, row_bytes("Q4_K", 256), dtype=torch.uint8), "Q4_K",
                      (experts, 256, 256)) for _ in range(3)]


@pytest.mark.parametrize("experts,top_k,stack", [(64, 6, "q4_k"), (128, 8, "f16"), (128, 8, "q4_k-mmq")],
                         ids=["deepseek-v2-lite-q4_k", "qwen3-30b-a3b-f16", "qwen3-30b-a3b-q4_k-mmq"])
def test_the_warm_up_counts_reach_every_moe_variant(monkeypatch, experts, top_k, stack):
    """At real expert counts and top_k, up to the default 2,048 tokens a step and 64 sequences, on the Triton target
    (the int8 GEMV from 64 slots; nothing runs), Q4_K stacks with moe_mmq on or off: the token counts the eager
    warm-ups take (decode_rows, then counts_by_class past 16) launch every variant of moe.moe_experts that any count
    1..2,048 launches. Before
    moe.slot_key, Qwen3-30B-A3B's 17 tokens (dense) and 33 (Q4_K, moe_mmq on) launched moe_align's kernel with a
    block count of an integer class no warm-up count had."""
    import torch

    from backends.cuda.warm_batches import counts_by_class, decode_rows
    from kernels_src import moe, moe_mmq

    monkeypatch.setattr(moe_mmq, "MMQ", stack == "q4_k-mmq")
    most, w = 2048, stacks(experts, stack != "f16")
    variants = Variants(monkeypatch)
    variants.run = "none"

    def step(tokens: int) -> None:
        ids = (torch.arange(tokens * top_k, dtype=torch.int32) % experts).reshape(tokens, top_k)  # moe_route's dtype
        moe.moe_experts(torch.zeros(tokens, 256, dtype=torch.float16), torch.zeros(tokens, top_k), ids, *w,
                        target="triton")

    warm = sorted({*decode_rows(64, experts, top_k), *counts_by_class(16, most, experts, top_k)})
    for tokens in warm:
        step(tokens)
    for tokens in range(1, most + 1):
        variants.step = tokens
        step(tokens)
    assert [(s, v.kernel, v.constexprs, v.args) for s, v in variants.new()] == []
