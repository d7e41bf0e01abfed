"""Block manager and scheduler without a model: ref counts, prefix sharing, LRU reuse, preemption."""

from __future__ import annotations

import numpy as np
import pytest

from core.sampling_params import SamplingParams
from frontend.engine.block_manager import BlockManager
from frontend.engine.scheduler import Scheduler, SchedulerConfig
from frontend.engine.sequence import Sequence, Status


def seq(tokens, max_tokens=16, parent=None):
    return Sequence("r", 0, list(tokens), SamplingParams(max_tokens=max_tokens), np.random.default_rng(0),
                    parent=parent)


def test_allocate_and_free_counts():
    bm = BlockManager(10, 4)
    s = seq(range(10))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    assert s.num_computed_tokens == 0
    bm.free_seq(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_prefix_blocks_are_shared_only_once_computed():
    bm = BlockManager(10, 4)
    a, b = seq(range(10)), seq(list(range(8)) + [99, 98, 97])
    bm.allocate(a)
    assert bm.cached_prefix(b) == [], "nothing is shared before it is computed"
    a.num_computed_tokens = 10
    bm.commit(a)
    hits = bm.cached_prefix(b)
    assert [h.block_id for h in hits] == a.block_table[:2]
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free_seq(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.free_seq(b)
    assert bm.num_free_blocks == 10


def test_chained_hash_needs_the_same_prefix():
    bm = BlockManager(10, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.commit(a)
    other = seq([0, 0, 0, 0, 5, 6, 7, 8, 9])  # second block equal, first not
    assert bm.cached_prefix(other) == []
    bm.free_seq(a)


def test_freed_prefix_is_reused_until_evicted():
    bm = BlockManager(4, 4)
    a = seq(range(9))
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.commit(a)
    first_two = a.block_table[:2]
    bm.free_seq(a)
    again = seq(range(9))
    bm.allocate(again)
    assert again.block_table[:2] == first_two and again.num_computed_tokens == 8
    bm.free_seq(again)
    filler = seq(range(100, 116))  # needs all 4 blocks: evicts the cached ones
    bm.allocate(filler)
    assert bm.cached == {} or all(bm.blocks[b].hash is None for b in filler.block_table)
    bm.free_seq(filler)
    assert bm.cached_prefix(seq(range(9))) == []


def test_full_prompt_hit_still_recomputes_last_token():
    bm = BlockManager(8, 4)
    a = seq(range(8))
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.commit(a)
    b = seq(range(8))
    bm.allocate(b)
    # The hit stops before the last token's block (vLLM's num_tokens - 1 cap): it is recomputed in b's own block.
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0] != b.block_table[1]
    bm.free_seq(a)
    bm.free_seq(b)


def test_fork_shares_full_blocks_and_copies_nothing_else():
    bm = BlockManager(10, 4)
    parent = seq(range(10))
    bm.allocate(parent)
    parent.num_computed_tokens = 10
    child = seq(range(10), parent=parent)
    bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert child.num_computed_tokens == 8
    bm.free_seq(parent)
    bm.free_seq(child)
    assert bm.num_free_blocks == 10


def test_double_free_is_caught():
    bm = BlockManager(4, 4)
    s = seq(range(3))
    bm.allocate(s)
    table = list(s.block_table)
    bm.free_seq(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        bm.free_seq(s)


def test_scheduler_chunks_prefill_and_preempts_newest():
    bm = BlockManager(6, 4, prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=5), bm)
    a, b = seq(range(8)), seq(range(50, 58))
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [(s.seq, s.num_new) for s in step] == [(a, 5), (b, 5)]
    for s in step:
        s.seq.num_computed_tokens += s.num_new
    step = sched.schedule()
    assert [(s.seq, s.num_new) for s in step] == [(a, 3), (b, 3)]
    assert all(s.samples for s in step)
    for s in step:
        s.seq.num_computed_tokens += s.num_new
    # Both hold 2 of the 6 blocks; at 13 tokens each needs a 4th, which is not there for both.
    for t in range(5):
        a.output_token_ids.append(t)
        b.output_token_ids.append(t)
        step = sched.schedule()
        for s in step:
            s.seq.num_computed_tokens += s.num_new
    assert b.status is Status.WAITING and b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert a.status is Status.RUNNING
    sched.finish(a, "stop")
    sched.finish(b, "abort")
    assert bm.num_free_blocks == 6


def _run(sched, step):
    for s in step:
        sampled = s.samples
        s.seq.num_computed_tokens += s.num_new
        if sampled:
            s.seq.output_token_ids.append(0)


@pytest.mark.parametrize("decode_tokens", [0, 24])
def test_steps_with_waiting_streams_keep_to_the_decode_budget(decode_tokens):
    """While a stream waits for its next token a step takes at most decode_step_tokens (new prompts enter in smaller
    pieces beside the decodes, which bounds the inter-token latency); with nothing streaming, or the budget off (0),
    it fills max_num_batched_tokens; the decodes themselves are never cut."""
    bm = BlockManager(64, 4, prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, prefill_chunk_size=32,
                          decode_step_tokens=decode_tokens)
    sched = Scheduler(cfg, bm)
    first = seq(range(20))
    sched.add(first)
    _run(sched, sched.schedule())  # 20 tokens, first token out: `first` now streams
    for k in range(4):
        sched.add(seq(range(100 * (k + 1), 100 * (k + 1) + 30)))
    step = sched.schedule()
    total = sum(s.num_new for s in step)
    assert (step[0].seq, step[0].num_new) == (first, 1)  # the decode comes first and whole
    assert total == (24 if decode_tokens else 64)
    _run(sched, step)
    # Decodes beyond the budget: every one still runs whole; the prompts left creep on by the spread term's token.
    while len(streaming := [q for q in sched.running if q.output_token_ids]) < 3:
        _run(sched, sched.schedule())
    cfg.decode_step_tokens = 2  # the floor alone (no share per stream, the prompts left spread very thin)
    cfg.decode_step_ratio, cfg.prefill_spread_steps = 1.0, 10**6
    step = sched.schedule()
    assert sum(s.num_new for s in step) == len(streaming) + 1
    decodes = [s for s in step if s.seq in streaming]
    assert len(decodes) == len(streaming) and all(s.num_new == 1 for s in decodes)
    # Nothing streaming: the full budget again.
    for q in [*sched.running, *sched.waiting]:
        sched.finish(q, "stop")
    sched.add(seq(range(500, 600), max_tokens=4))
    assert sum(s.num_new for s in sched.schedule()) == 32  # one prompt's chunk: prefill_chunk_size
    assert sched.step_budget() == 64
