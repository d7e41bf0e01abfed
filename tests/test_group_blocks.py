"""KV groups without a model (core.kv_layout, frontend/engine/group_blocks.py): the layout read from windows, the
pool split rule, a sliding group letting its blocks go, the prefix-hit and fork rules, preemption and aborts. The
sequences advance as the engine advances them (computed tokens, one sampled token, commit), so every count is the
real block manager's; after every step each block's ref count must equal the table entries that name it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from core.kv_layout import NULL_BLOCK, KVLayout, KVLimits
from core.sampling_params import SamplingParams
from frontend.engine.group_blocks import GroupedBlockManager
from frontend.engine.scheduler import Scheduler, SchedulerConfig
from frontend.engine.sequence import Sequence, Status

BS, WINDOW, STEP = 4, 6, 8
LAYOUT = KVLayout.from_layers([WINDOW, None], [(1, 8, 8), (2, 8, 8)])  # gemma2's: sliding, then global
SLIDING_NEED = -(-(WINDOW + STEP) // BS) + 1  # KVGroup.blocks_per_seq: 5
KEPT_AFTER_STEP = -(-WINDOW // BS) + 1  # a decoding sequence's sliding blocks after its step: 3


def seq(prompt: list[int], max_tokens: int = 16, parent: Sequence | None = None) -> Sequence:
    return Sequence("r", 0, list(prompt), SamplingParams(max_tokens=max_tokens), np.random.default_rng(0),
                    parent=parent)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def check_accounting(blocks: GroupedBlockManager, seqs: list[Sequence]) -> None:
    """Each block's ref count is the number of held table entries naming it; the free list is exactly the unheld
    blocks; a sliding pool's null block is held by no one and never free; let-go entries name the null block."""
    for g, pool in enumerate(blocks.pools):
        held = Counter()
        for s in seqs:
            if len(s.kv) > g:
                gb = s.kv[g]
                assert all(b == NULL_BLOCK for b in gb.table[:gb.num_freed])
                held.update(gb.table[gb.num_freed:])
                assert list(gb.array()) == gb.table
        for blk in pool.blocks:
            assert blk.ref_count == held[blk.block_id], (g, blk)
        unheld = {b.block_id for b in pool.blocks if b.ref_count == 0} - ({NULL_BLOCK} if pool.window else set())
        assert set(pool.free) == unheld
        assert pool.window is None or held[NULL_BLOCK] == 0


def step(sched: Scheduler, blocks: GroupedBlockManager, finished: list[Sequence]) -> list:
    """One engine step without a model: schedule, compute, sample a token where the step reaches the end, commit."""
    scheduled = sched.schedule()
    for s in scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new
        if samples:
            s.seq.output_token_ids.append(7)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
                finished.append(s.seq)
    for s in scheduled:
        if not s.seq.finished:
            blocks.commit(s.seq)
    return scheduled


def test_layout_groups_layers_by_window():
    assert LAYOUT.group_of == (1, 0) and [g.window for g in LAYOUT.groups] == [None, WINDOW]
    three = KVLayout.from_layers([4, 8, None, 4], [(1, 2, 2)] * 4)
    assert [g.window for g in three.groups] == [None, 8, 4] and three.group_of == (2, 1, 0, 2)
    assert three.groups[2].layers == (0, 3)
    one = KVLayout.from_layers([4096, 4096], [(1, 2, 2)] * 2)  # every layer the same window: held whole
    assert one.num_groups == 1 and one.groups[0].window is None
    assert LAYOUT.group_bytes(0, BS, 2) == BS * 2 * 2 * 16 and LAYOUT.group_bytes(1, BS, 2) == BS * 2 * 16


def test_split_rule():
    limits = KVLimits(BS, max_num_seqs=4, max_model_len=128, step_tokens=STEP)
    assert LAYOUT.groups[1].blocks_per_seq(limits) == SLIDING_NEED
    assert LAYOUT.groups[0].blocks_per_seq(limits) == 32
    assert LAYOUT.pools(64, limits) == [64, 4 * SLIDING_NEED + 1]  # what 4 sequences can use, + the null block
    assert LAYOUT.pools(10, limits) == [10, 11]  # never more usable blocks than group 0's
    sizes = [LAYOUT.group_bytes(g, BS, 2) for g in range(2)]
    for budget in (10_000, 100_000, 1_000_000):
        pools = LAYOUT.pools_for_budget(budget, sizes, limits)
        cost = sum(p * b for p, b in zip(pools, sizes, strict=True))
        bigger = LAYOUT.pools(pools[0] + 1, limits)
        assert cost <= budget < sum(p * b for p, b in zip(bigger, sizes, strict=True))
    one = KVLayout.from_layers([None], [(1, 8, 8)])
    assert one.pools_for_budget(1000, [7], limits) == [142]  # one group: budget // bytes, as before groups


def test_a_sliding_group_holds_only_its_window():
    blocks = GroupedBlockManager(LAYOUT, [64, 4 * SLIDING_NEED + 1], BS, prefix_caching=False, step_tokens=STEP)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=STEP), blocks)
    seqs = [seq(tokens(1, 40), 20), seq(tokens(2, 27), 30)]
    for s in seqs:
        sched.add(s)
    done: list[Sequence] = []
    peak = 0
    while sched.has_work():
        for s in step(sched, blocks, done):
            if s.seq.finished:
                continue
            full, sliding = (len(gb.table) - gb.num_freed for gb in s.seq.kv)
            assert full == -(-max(s.seq.num_computed_tokens, s.seq.num_prompt_tokens) // BS)  # every token
            assert sliding <= SLIDING_NEED
            if s.seq.prefilled:
                assert sliding <= KEPT_AFTER_STEP
            peak = max(peak, full)
        check_accounting(blocks, seqs)
    assert peak >= 14 and len(done) == 2 and blocks.num_free_blocks == blocks.num_blocks


def test_prefix_hit_needs_every_groups_window():
    blocks = GroupedBlockManager(LAYOUT, [64, 21], BS, prefix_caching=True, step_tokens=STEP)
    prompt = tokens(3, 30)
    a = seq(prompt)
    blocks.allocate(a)
    while a.num_computed_tokens < a.num_tokens:  # prefilled in chunks, committed after each
        blocks.append_slots(a, min(STEP, a.num_tokens - a.num_computed_tokens))
        a.num_computed_tokens = min(a.num_computed_tokens + STEP, a.num_tokens)
        blocks.commit(a)
    assert a.kv[1].num_freed == (30 - WINDOW + 1) // BS  # let go, kept in the prefix cache
    a_full = list(a.kv[0].table[:7])
    blocks.free_seq(a)
    sliding = blocks.pools[1]
    sliding_ids = {}  # block index of the prompt -> its block in the sliding pool (found by hash)
    for i, (h, toks) in enumerate(a.block_hashes[:7]):
        sliding_ids[i] = sliding._lookup(h, toks).block_id

    def hit(extra: list[int]) -> Sequence:
        b = seq(prompt + extra)
        assert blocks.can_allocate(b)
        blocks.allocate(b)
        check_accounting(blocks, [b])
        return b

    def evict(index: int) -> None:  # the pool needs the space: the block is handed out and its hash forgotten
        bid = sliding_ids[index]
        sliding.free.move_to_end(bid, last=False)
        assert sliding.take().block_id == bid
        sliding._release(bid)

    b = hit([])  # capped below the last token: 7 blocks; the sliding group keeps blocks 5 and 6 of them
    assert b.num_computed_tokens == 28 and b.num_cached_tokens == 28
    assert b.kv[1].num_freed == 5 and b.kv[1].table[5:7] == [sliding_ids[5], sliding_ids[6]]
    assert b.kv[0].table[:7] == a_full
    blocks.free_seq(b)
    evict(6)  # the window of a query at 28 is gone: at 24 it needs blocks 4 and 5, still cached
    b = hit(tokens(4, 5))
    assert b.num_computed_tokens == 24 and b.kv[1].num_freed == 4
    blocks.free_seq(b)
    evict(4)  # block 4 too: a query at 24 or 20 needs it, one at 16 needs blocks 2 and 3
    b = hit([])
    assert b.num_computed_tokens == 16 and b.kv[1].num_freed == 2
    assert b.kv[0].table[:4] == a_full[:4]
    blocks.free_seq(b)
    for i in range(4):
        evict(i)
    b = hit([])  # nothing of the sliding group left in reach: nothing reused, in either group
    assert b.num_computed_tokens == 0 and b.kv[1].num_freed == 0
    blocks.free_seq(b)
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_sibling_shares_what_its_parent_or_the_cache_holds(prefix_caching):
    blocks = GroupedBlockManager(LAYOUT, [64, 21], BS, prefix_caching=prefix_caching, step_tokens=32)
    parent = seq(tokens(5, 30))
    blocks.allocate(parent)
    parent.num_computed_tokens = 30  # one chunk
    blocks.commit(parent)
    child = seq(parent.prompt_token_ids, parent=parent)
    assert blocks.can_fork(parent, child)
    blocks.fork(parent, child)
    check_accounting(blocks, [parent, child])
    if prefix_caching:  # the parent let blocks 0-5 of its sliding group go, still cached: the child takes 5 and 6
        assert child.num_computed_tokens == 28 and child.kv[0].table[:7] == parent.kv[0].table[:7]
        assert child.kv[1].table[6] == parent.kv[1].table[6] and child.kv[1].num_freed == 5
    else:  # block 5, which a query at 28 (or any earlier one) needs, is gone: nothing is shared
        assert child.num_computed_tokens == 0
    assert child.num_cached_tokens == 0
    for s in (parent, child):
        blocks.free_seq(s)
    assert blocks.num_free_blocks == blocks.num_blocks


class Refusals(GroupedBlockManager):
    """Records which pool refused each append the scheduler asked for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.refused: list[int] = []

    def can_append(self, seq, num_new):
        ok = [p.can_append(seq, num_new) for p in self.pools]
        self.refused += [g for g, o in enumerate(ok) if not o]
        return all(ok)


def test_preemption_and_aborts_free_every_group_and_the_split_lets_group_0_run_out_first():
    limits = KVLimits(BS, max_num_seqs=6, max_model_len=64, step_tokens=STEP)
    pools = LAYOUT.pools(40, limits)  # 6 sequences of up to 16 blocks want 96 of group 0's: preemptions
    blocks = Refusals(LAYOUT, pools, BS, prefix_caching=True, step_tokens=STEP)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, prefill_chunk_size=STEP), blocks)
    rng = np.random.default_rng(6)
    seqs = []
    for i in range(10):
        n = int(rng.integers(5, 40))
        seqs.append(seq(tokens(10 + i % 4, n), 64 - n))  # prompts shared four ways: prefix hits too
        sched.add(seqs[-1])
    done: list[Sequence] = []
    steps = 0
    while sched.has_work():
        step(sched, blocks, done)
        steps += 1
        if steps == 30:  # an abort, wherever it is
            victim = next(s for s in seqs if s.status is Status.RUNNING)
            sched.finish(victim, "abort")
            done.append(victim)
        check_accounting(blocks, seqs)
    assert sched.num_preemptions > 0 and len(done) == 10 and any(s.num_cached_tokens for s in seqs)
    assert blocks.refused and set(blocks.refused) == {0}, "a sliding pool ran out before group 0's"
    assert blocks.num_free_blocks == blocks.num_blocks
