"""Fixed-size KV blocks: a free list, ref counts, per-sequence block tables, and a prefix cache.

A full block is identified by a hash chained with its predecessor's, so equal hashes mean equal
prefixes. Freed blocks keep their hash and stay reusable until the space is needed (LRU).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from frontend.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

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

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self.cached_prefix(seq)
        reclaimed = sum(1 for b in hits if b.ref_count == 0)  # hits sitting in the free list
        return self.blocks_for(seq.num_tokens) - len(hits) <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its current tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self.cached_prefix(seq)
        for blk in hits:
            if blk.ref_count == 0:
                del self.free[blk.block_id]
            blk.ref_count += 1
            seq.block_table.append(blk.block_id)
        for _ in range(self.blocks_for(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take().block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:  # usage reports prompt tokens found cached, not a preempted sequence's own
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _take(self) -> Block:
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None and self.cached.get(blk.hash) == bid:
            del self.cached[blk.hash]
        blk.hash, blk.tokens, blk.ref_count = None, (), 1
        return blk

    def can_append(self, seq: Sequence, num_new: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new: int) -> None:
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_new):
            seq.block_table.append(self._take().block_id)

    def commit(self, seq: Sequence) -> None:
        """Publish the blocks that `seq` has filled completely, so that later sequences can share them."""
        if not self.prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_committed_blocks:  # a decode step that filled no block: nothing to publish
            return
        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        # Blocks below num_committed_blocks were published by an earlier call, or were hits and forks that already
        # carried their hash; a block a sequence holds is never handed out again, so they stay so: skip them.
        for i in range(seq.num_committed_blocks, full):
            blk = self.blocks[seq.block_table[i]]
            if blk.hash is None:
                h, toks = hashes[i]
                blk.hash, blk.tokens = h, toks
                self.cached.setdefault(h, blk.block_id)
        seq.num_committed_blocks = full

    def free_seq(self, seq: Sequence) -> None:
        # Last blocks first into the LRU list, so a prefix outlives its tails.
        for bid in reversed(seq.block_table):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            assert blk.ref_count >= 0, f"block {bid} freed twice"
            if blk.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full prompt blocks with a sibling; it recomputes only the partial tail."""
        full = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        for bid in parent.block_table[:full]:
            self.blocks[bid].ref_count += 1
            child.block_table.append(bid)
        for _ in range(self.blocks_for(child.num_tokens) - full):
            child.block_table.append(self._take().block_id)
        child.num_computed_tokens = full * self.block_size  # shared with a sibling: not "cached" in usage
