"""Prefix-cache hits that must not reach the last token, and the cached-token count that usage reports."""

from __future__ import annotations

import numpy as np

from core.sampling_params import SamplingParams
from frontend.engine.block_manager import BlockManager
from frontend.engine.sequence import Sequence

BS = 16


def seq(tokens: list[int], out: list[int] | None = None) -> Sequence:
    s = Sequence("r", 0, list(tokens), SamplingParams(), np.random.default_rng(0))
    s.output_token_ids = list(out or [])
    return s


def computed(blocks: BlockManager, s: Sequence) -> None:
    s.num_computed_tokens = s.num_tokens
    blocks.commit(s)


def test_a_full_hit_leaves_the_last_block_to_the_new_sequence():
    rng = np.random.default_rng(0)
    blocks = BlockManager(16, BS)
    prompt = rng.integers(0, 1000, 2 * BS).tolist()  # exactly two full blocks
    a = seq(prompt)
    blocks.allocate(a)
    computed(blocks, a)
    b = seq(prompt)
    assert blocks.can_allocate(b)
    blocks.allocate(b)
    # The first block is shared; the block holding the last token (recomputed for its logits) is b's own.
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == BS == b.num_cached_tokens
    assert blocks.blocks[a.block_table[1]].ref_count == 1


def test_cached_tokens_never_exceed_the_prompt_after_a_preemption():
    rng = np.random.default_rng(1)
    blocks = BlockManager(16, BS)
    s = seq(rng.integers(0, 1000, 20).tolist(), rng.integers(0, 1000, 30).tolist())
    blocks.allocate(s)
    assert s.num_cached_tokens == 0
    computed(blocks, s)
    blocks.free_seq(s)  # preempted: recomputed later from its own (now cached) blocks
    s.num_preemptions += 1
    blocks.allocate(s)
    assert s.num_computed_tokens == 3 * BS  # the recompute does reuse them
    assert s.num_cached_tokens == 0 <= s.num_prompt_tokens


def test_blocks_shared_with_a_sibling_are_not_cached():
    rng = np.random.default_rng(2)
    blocks = BlockManager(16, BS)
    parent = seq(rng.integers(0, 1000, 40).tolist())
    blocks.allocate(parent)
    computed(blocks, parent)
    child = seq(parent.prompt_token_ids)
    blocks.fork(parent, child)
    assert child.num_computed_tokens == 2 * BS and child.num_cached_tokens == 0 == parent.num_cached_tokens
