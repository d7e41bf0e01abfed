"""ir.sharding against one process: every rank's graph on the numpy interpreter (ir.tp_reference, a thread a rank,
collectives met in memory), fused as the backends run them, gives the greedy tokens of the whole graph and logits
within 1e-5 of max|logit| (fp32). The tiny models have 4 query and 2 KV heads, so 4 ranks replicate KV heads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from test_tiny_gguf import files  # noqa: F401  (a fixture)
from test_tiny_gguf import prompt as gguf_prompt
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)
from tiny_hf import assert_close

from ir.loader import load_model
from ir.reference import ReferenceRunner
from ir.sharding import cut_tensor, param_cuts, shard
from ir.tp_reference import ShardedReference
from ir.weights import StoredTensor
from tools import check_arch

TP_TOL = 1e-5  # of max|logit|: fp32 sums in another order; a wrong shard moves logits by whole units


def assert_ranks_match_one(model, world: int, prompts, new: int, max_tokens: int = 64) -> None:
    """`world` ranks of the sharded reference against one process: identical greedy tokens, first logits within
    TP_TOL."""
    tokens, first = ReferenceRunner(model, max_tokens=max_tokens, block_size=4).greedy(prompts, new)
    ranks = ShardedReference(model, world, max_tokens=max_tokens, block_size=4, fused=True)
    tp_tokens, tp_first = ranks.greedy(prompts, new)
    assert tp_tokens == tokens
    assert_close(tp_first, first, TP_TOL)


@pytest.mark.parametrize("case", ["llama3_rope", "llama_bias_tied", "qwen3", "mistral_window"])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_one_process(case, world, saved):  # noqa: F811
    model = load_model(saved(case)[1], progress=False)
    assert_ranks_match_one(model, world, [prompt(1), prompt(2, 9), prompt(3, 17)], 4)
    # each rank holds its share: a quarter (a half) of the query heads, and of the KV heads or one of them
    graph = shard(model.graph, 1, world)
    assert graph.params["layers.0.wq"].shape[0] == model.graph.params["layers.0.wq"].shape[0] // world
    assert graph.params["layers.0.wk"].shape[0] == model.graph.params["layers.0.wk"].shape[0] // min(world, 2)


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_gguf_blocks_cut_per_rank(case, files):  # noqa: F811
    """GGUF files of several block types (llama's q/k rows un-permuted at load): each rank's quantized tensors are
    cut from the blocks, and the ranks still give one process's tokens and logits."""
    path, kinds, _ = files(case)
    assert len({k.name for k in kinds.values()}) > 2
    model = load_model(path, progress=False)
    assert_ranks_match_one(model, 2, [gguf_prompt(1), gguf_prompt(2, 9)], 3)


def test_kv_heads_replicated_where_fewer_than_ranks(saved):  # noqa: F811
    """2 KV heads of 16 over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1, the one their q heads read."""
    graph = load_model(saved("qwen3")[1], progress=False).graph
    got = [param_cuts(graph, r, 4)["layers.0.wk"] for r in range(4)]
    assert got == [(0, 0, 16), (0, 0, 16), (0, 16, 32), (0, 16, 32)]
    assert [param_cuts(graph, r, 4)["layers.0.wq"] for r in range(4)] == [(0, 16 * r, 16 * r + 16) for r in range(4)]
    assert param_cuts(graph, 1, 4)["layers.0.wo"] == (1, 16, 32)


def test_mixture_of_experts_split_inside_each_expert(tmp_path):
    """qwen2_moe (routed experts, a sigmoid-gated shared expert, a dense layer) over 2 and 4 ranks against
    transformers, as the other engines are checked (tools/check_arch)."""
    path = tmp_path / "qwen2_moe.json"
    path.write_text('{"model_type": "qwen2_moe", "decoder_sparse_step": 2, "norm_topk_prob": false}')
    rows = check_arch.check(str(path), ["tp2", "tp4"], new=4)
    assert len(rows) == 6 and all(r.ok and r.rel_err < 1e-4 for r in rows), rows


@pytest.mark.parametrize("world, message", [(3, "power of two from 1 to 8"), (16, "power of two from 1 to 8"),
                                             (8, "layers.0.wq [64, 64] has 4 heads")])
def test_world_sizes_that_do_not_fit_are_refused(world, message, saved):  # noqa: F811
    graph = load_model(saved("qwen3")[1], progress=False).graph
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        shard(graph, 0, world)


def test_quantized_cuts_keep_their_blocks():
    """Row and block-aligned column cuts of Q8_0 blocks decode to the same values as the decoded tensor's cut;
    a cut inside a block is decoded first."""
    values = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    q = StoredTensor(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), "Q8_0", (8, 128))
    whole = q.dequantize().reshape(8, 128)
    for axis, start, stop, kind in [(0, 2, 6, "Q8_0"), (1, 64, 128, "Q8_0"), (1, 16, 48, "F32")]:
        cut = cut_tensor(q, axis, start, stop)
        assert cut.kind == kind
        np.testing.assert_array_equal(cut.dequantize().reshape(cut.shape),
                                      np.take(whole, np.arange(start, stop), axis=axis))


@pytest.mark.parametrize("case", ["gqa9_3", "gqa6_3", "mha3"])
def test_heads_split_unevenly_by_kv_group(case, saved):  # noqa: F811
    """3 KV groups over 2 ranks: rank 0 holds groups 0-1, rank 1 group 2, each with its query heads and o's columns;
    the ranks still give one process's tokens and logits (llama with biases, qwen3 with q/k norms)."""
    model = load_model(saved(case)[1], progress=False)
    graph = model.graph
    q_heads, kv_heads = (9, 3) if case == "gqa9_3" else (6, 3) if case == "gqa6_3" else (3, 3)
    d = graph.params["layers.0.wq"].shape[0] // q_heads
    group = q_heads // kv_heads
    for name, heads, axis in [("layers.0.wq", q_heads, 0), ("layers.0.wk", kv_heads, 0), ("layers.0.wv", kv_heads, 0),
                              ("layers.0.wo", q_heads, 1)] + [(f"layers.0.b{x}", h, 0) for x, h in
                                                              [("q", q_heads), ("k", kv_heads)] if case == "mha3"]:
        per = d * (group if heads == q_heads else 1)  # rows (columns) of one KV group
        cuts = [param_cuts(graph, r, 2)[name] for r in range(2)]
        assert cuts == [(axis, 0, 2 * per), (axis, 2 * per, 3 * per)], (name, cuts)
        assert cuts[0][2] == cuts[1][1] and cuts[1][2] == graph.params[name].shape[axis]  # the whole, no overlap
    ranks = [shard(graph, r, 2) for r in range(2)]
    assert [g.attention_nodes()[0].inputs[1].shape[1] for g in ranks] == [2, 1]
    assert [g.attention_nodes()[0].inputs[0].shape[1] for g in ranks] == [2 * group, group]
    assert_ranks_match_one(model, 2, [prompt(1), prompt(2, 9)], 3)


def test_kv_groups_split_unevenly_over_four_and_eight_ranks():
    """Contiguous ranges, the first groups % world ranks one more: 3 of 2, 10 of 4 (Phi-3-medium's 40 / 10 at TP 4),
    and 4 of 8 falls to replication (fewer groups than ranks) rather than a range."""
    from ir.sharding import kv_group_range

    assert [kv_group_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [kv_group_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [kv_group_range(8, 8, r) for r in range(8)] == [(r, r + 1) for r in range(8)]


def test_replicated_kv_heads_split_their_query_group_unevenly(saved):  # noqa: F811
    """6 query / 2 KV heads over 4 ranks: ranks 0, 1 hold KV head 0 and query heads 0-1 and 2; ranks 2, 3 KV head 1
    and query heads 3-4 and 5 (o's columns alike); the ranks give one process's tokens and logits."""
    model = load_model(saved("gqa6_2")[1], progress=False)
    cuts = [param_cuts(model.graph, r, 4) for r in range(4)]
    assert [c["layers.0.wk"] for c in cuts] == [(0, 0, 8), (0, 0, 8), (0, 8, 16), (0, 8, 16)]
    assert [c["layers.0.wq"] for c in cuts] == [(0, 0, 16), (0, 16, 24), (0, 24, 40), (0, 40, 48)]
    assert [c["layers.0.wo"] for c in cuts] == [(1, 0, 16), (1, 16, 24), (1, 24, 40), (1, 40, 48)]
    assert_ranks_match_one(model, 4, [prompt(1), prompt(2, 9)], 3)


def test_kv_groups_fewer_than_ranks_and_not_a_divisor_are_refused(saved):  # noqa: F811
    """3 KV groups over 4 ranks: one rank would hold none, and 4 is no multiple of 3 to replicate them."""
    graph = load_model(saved("gqa9_3")[1], progress=False).graph
    with pytest.raises(ValueError, match=r"layers.0.wq \[72, 72\] has 9 heads, of 3 KV groups: each rank needs"):
        shard(graph, 0, 4)


def test_smollm2_over_two_ranks(smollm):
    """SmolLM2-135M's GGUF (9 query / 3 KV heads, Q4_1 blocks, o's columns cut at a block boundary, 384 of 576) over
    2 ranks: one process's greedy tokens and logits."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1562, 25, 8, 44, 99, 1005, 23, 32, 3000]]
    assert_ranks_match_one(smollm, 2, prompts, 4, max_tokens=48)
    assert param_cuts(smollm.graph, 1, 2)["layers.0.wo"] == (1, 384, 576)
