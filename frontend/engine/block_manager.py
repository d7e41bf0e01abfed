"""Fixed-size KV blocks: a free list, ref counts, per-sequence block tables, and a prefix cache.

A full block is identified by a hash chained with its predecessor's, so equal hashes mean equal
prefixes. Freed blocks keep their hash and stay reusable until the space is needed (LRU).

One BlockManager is one pool: a one-group model's whole cache, or one KV group's (`group`; the engine's
GroupedBlockManager, in group_blocks.py, then runs one per group). A sliding group's pool (`window`) keeps block 0
back as its null block (core.kv_layout) and lets a sequence's leading blocks go (`release_before`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from core.kv_layout import NULL_BLOCK
from frontend.engine.sequence import GroupBlocks, Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, group: int = 0,
                 window: int | None = None):
        first = 0 if window is None else NULL_BLOCK + 1  # a sliding pool's null block is never handed out
        if num_blocks < first + 1:
            raise ValueError(f"the KV cache must hold at least one block{' besides its null block' * first}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.group, self.window = group, window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_blocks = num_blocks - first  # the blocks sequences can hold

    @property
    def token_capacity(self) -> int:
        """The most tokens one sequence can hold."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[tuple[int, tuple[int, ...]]]:
        """The hashes of the full blocks among the first `num_tokens` tokens: `seq.block_hashes`, of which only
        those first ones are read (the list may hold more). A sequence's tokens never change once written, so
        each block's hash is computed once and kept."""
        known = seq.block_hashes
        for b in range(len(known), num_tokens // self.block_size):
            toks = tuple(seq.tokens(b * self.block_size, (b + 1) * self.block_size))
            known.append((block_hash(known[-1][0] if known else None, toks), toks))
        return known

    def _lookup(self, h: int, toks: tuple[int, ...]) -> Block | None:
        bid = self.cached.get(h)
        if bid is None or self.blocks[bid].tokens != toks:
            return None
        return self.blocks[bid]

    def cached_prefix(self, seq: Sequence) -> list[Block]:
        """Blocks of the cache that already hold a prefix of `seq` (full blocks only).

        Capped below the last token (vLLM does the same): its logits are needed, so it is computed again, and its
        K/V must go to a block of this sequence's own, never into a block that running sequences share (in
        bf16/f16 the recomputed values differ with the batch and would change a neighbour's cache)."""
        if not self.prefix_caching:
            return []
        hits = []
        full = (seq.num_tokens - 1) // self.block_size
        for h, toks in itertools.islice(self._full_block_hashes(seq, seq.num_tokens - 1), full):
            blk = self._lookup(h, toks)
            if blk is None:
                break
            hits.append(blk)
        return hits

    def _group(self, seq: Sequence) -> GroupBlocks:
        while len(seq.kv) <= self.group:
            seq.kv.append(GroupBlocks())
        return seq.kv[self.group]

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self.cached_prefix(seq)
        reclaimed = sum(1 for b in hits if b.ref_count == 0)  # hits sitting in the free list
        return self.blocks_for(seq.num_tokens) - len(hits) <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its current tokens, reusing cached prefix blocks."""
        table = self._group(seq).table
        assert not table, "sequence already holds blocks"
        hits = self.cached_prefix(seq)
        for blk in hits:
            self.hold(blk)
            table.append(blk.block_id)
        for _ in range(self.blocks_for(seq.num_tokens) - len(hits)):
            table.append(self.take().block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:  # usage reports prompt tokens found cached, not a preempted sequence's own
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def hold(self, blk: Block) -> None:
        """One more sequence holds `blk` (a prefix hit, or a sibling's block)."""
        if blk.ref_count == 0:
            del self.free[blk.block_id]
        blk.ref_count += 1

    def take(self) -> Block:
        """A free block, the least recently used first (its cached prefix forgotten)."""
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None and self.cached.get(blk.hash) == bid:
            del self.cached[blk.hash]
        blk.hash, blk.tokens, blk.ref_count = None, (), 1
        return blk

    def can_append(self, seq: Sequence, num_new: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new) - len(seq.kv[self.group].table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new: int) -> None:
        table = seq.kv[self.group].table
        while len(table) < self.blocks_for(seq.num_computed_tokens + num_new):
            table.append(self.take().block_id)

    def has_room_for(self, num_blocks: int) -> bool:
        """Whether `num_blocks` new blocks can be taken without a preemption (a decode takes one at most)."""
        return self.num_free_blocks >= num_blocks

    def commit(self, seq: Sequence) -> None:
        """Publish the blocks that `seq` has filled completely, so that later sequences can share them."""
        if not self.prefix_caching:
            return
        gb = seq.kv[self.group]
        full = seq.num_computed_tokens // self.block_size
        if full <= gb.num_committed:  # a decode step that filled no block: nothing to publish
            return
        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        # Blocks below num_committed were published by an earlier call, or were hits and forks that already carried
        # their hash; a block a sequence holds is never handed out again, so they stay so: skip them (and the
        # entries let go, which hold the null block).
        for i in range(max(gb.num_committed, gb.num_freed), full):
            blk = self.blocks[gb.table[i]]
            if blk.hash is None:
                h, toks = hashes[i]
                blk.hash, blk.tokens = h, toks
                self.cached.setdefault(h, blk.block_id)
        gb.num_committed = full

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} freed twice"
        if blk.ref_count == 0:
            self.free[bid] = None

    def release_before(self, seq: Sequence, num_blocks: int) -> None:
        """Let `seq`'s first `num_blocks` entries go (a sliding pool: no future query reads them); they keep their
        hash, reusable as a prefix until the space is needed, and the table points at the null block there."""
        gb = seq.kv[self.group]
        table = gb.table
        for i in range(gb.num_freed, min(num_blocks, len(table))):
            self._release(table[i])
            table[i] = NULL_BLOCK
        gb.num_freed = max(gb.num_freed, min(num_blocks, len(table)))

    def free_seq(self, seq: Sequence) -> None:
        # Last blocks first into the LRU list, so a prefix outlives its tails.
        gb = seq.kv[self.group]
        table = gb.table
        for i in range(len(table) - 1, gb.num_freed - 1, -1):
            self._release(table[i])
        gb.table, gb.num_committed, gb.num_freed = [], 0, 0
        seq.num_computed_tokens = 0

    def can_fork(self, parent: Sequence, child: Sequence) -> bool:
        need = self.blocks_for(child.num_tokens) - parent.num_computed_tokens // self.block_size
        return need <= self.num_free_blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full prompt blocks with a sibling; it recomputes only the partial tail."""
        full = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        table = self._group(child).table
        for bid in parent.kv[self.group].table[:full]:
            self.blocks[bid].ref_count += 1
            table.append(bid)
        for _ in range(self.blocks_for(child.num_tokens) - full):
            table.append(self.take().block_id)
        child.num_computed_tokens = full * self.block_size  # shared with a sibling: not "cached" in usage
