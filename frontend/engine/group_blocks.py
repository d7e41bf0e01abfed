"""The blocks of a model with several KV groups (core.kv_layout): one pool (a BlockManager) per group, one block
table per group per sequence, behind the single pool's interface, so the scheduler and the engine need not know.

A sliding group holds only what its sequence's future queries read: after each step (`commit`) it lets go of every
block whose tokens all lie before the window of the sequence's next query, and it is given blocks for one step's
chunk at a time (a full group gets the whole prompt's at admission, as a single pool does).

Reuse (prefix cache, or an n > 1 sibling's blocks): h leading blocks are reused only where every group can give
what its queries after them read, its blocks [first_kept(h * block_size) // block_size, h) (all of them for a full
group), each from the parent's table or the prefix cache; h is the largest such (h = 0 always qualifies). Blocks
of every group are published under the same chained hash once filled (a sliding block before it is let go), so a
sliding block stays reusable after its sequence has let it go, until its pool needs the space.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from core.kv_layout import NULL_BLOCK, KVLayout
from frontend.engine.block_manager import Block, BlockManager
from frontend.engine.sequence import GroupBlocks, Sequence


class GroupedBlockManager:
    def __init__(self, layout: KVLayout, pools: Seq[int], block_size: int, prefix_caching: bool,
                 step_tokens: int):
        if len(pools) != layout.num_groups:
            raise ValueError(f"{len(pools)} pool sizes for {layout.num_groups} KV groups")
        self.layout = layout
        self.block_size, self.prefix_caching, self.step_tokens = block_size, prefix_caching, step_tokens
        self.pools = [BlockManager(n, block_size, prefix_caching, g, grp.window)
                      for g, (grp, n) in enumerate(zip(layout.groups, pools, strict=True))]

    # -- what the engine reads ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks sequences can hold, in every pool together."""
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def token_capacity(self) -> int:
        """The most tokens one sequence can hold: group 0's pool, unless a sliding pool is too small for a window."""
        cap = self.pools[0].token_capacity
        for grp, pool in zip(self.layout.groups[1:], self.pools[1:], strict=True):
            if pool.num_blocks < self._sliding_need(grp.window):
                cap = min(cap, pool.token_capacity)
        return cap

    def _sliding_need(self, window: int) -> int:
        return -(-(window + self.step_tokens) // self.block_size) + 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_room_for(self, num_blocks: int) -> bool:
        """Whether every pool can give `num_blocks` new blocks (a sliding group never needs more than a full one)."""
        return all(p.num_free_blocks >= num_blocks for p in self.pools)

    # -- admission ----------------------------------------------------------------------------------
    def _reuse(self, seq: Sequence, limit: int, parent: Sequence | None = None) -> tuple[int, list[list[Block]]]:
        """(h, each group's blocks [first kept, h)): the most leading blocks, up to `limit`, that `seq` can reuse
        (the module docstring's rule), from `parent`'s tables or the prefix cache."""
        bs = self.block_size
        hashes = self.pools[0]._full_block_hashes(seq, limit * bs) if self.prefix_caching and limit else None
        found: list[dict[int, Block | None]] = [{} for _ in self.pools]

        def block(g: int, i: int) -> Block | None:
            if i not in found[g]:
                pool, blk = self.pools[g], None
                if parent is not None:
                    pk = parent.kv[g]
                    if pk.num_freed <= i < len(pk.table):
                        blk = pool.blocks[pk.table[i]]
                if blk is None and hashes is not None:
                    blk = pool._lookup(*hashes[i])
                found[g][i] = blk
            return found[g][i]

        def first(g: int, h: int) -> int:
            return self.layout.groups[g].first_kept(h * bs) // bs

        h = limit
        for g, grp in enumerate(self.layout.groups):  # a full group's hits are a prefix: scan it forwards
            if not grp.slides:
                h = next((i for i in range(h) if block(g, i) is None), h)
        while h > 0:
            # From the top down: a block missing at i rules out every h' > i (they need it too), so try h = i.
            miss = next((i for g in range(len(self.pools)) for i in range(h - 1, first(g, h) - 1, -1)
                         if block(g, i) is None), None)
            if miss is None:
                break
            h = miss
        return h, [[found[g][i] for i in range(first(g, h), h)] for g in range(len(self.pools))]

    def _target(self, g: int, seq: Sequence, computed: int) -> int:
        """The entries group g's table needs at admission: the whole prompt's, or (sliding) one chunk's."""
        if self.layout.groups[g].slides:
            return self.blocks_for(min(seq.num_tokens, computed + self.step_tokens))
        return self.blocks_for(seq.num_tokens)

    def _fits(self, seq: Sequence, h: int, reuse: list[list[Block]]) -> bool:
        for g, pool in enumerate(self.pools):
            reclaimed = sum(1 for b in reuse[g] if b.ref_count == 0)  # reused blocks sitting in the free list
            if self._target(g, seq, h * self.block_size) - h > pool.num_free_blocks - reclaimed:
                return False
        return True

    def _place(self, seq: Sequence, h: int, reuse: list[list[Block]]) -> None:
        """Builds each group's table: the null block below what is kept, the reused blocks, then new ones."""
        while len(seq.kv) < len(self.pools):
            seq.kv.append(GroupBlocks())
        for g, pool in enumerate(self.pools):
            gb = seq.kv[g]
            assert not gb.table, "sequence already holds blocks"
            gb.num_freed = h - len(reuse[g])
            gb.table.extend([NULL_BLOCK] * gb.num_freed)
            for blk in reuse[g]:
                pool.hold(blk)
                gb.table.append(blk.block_id)
            for _ in range(self._target(g, seq, h * self.block_size) - h):
                gb.table.append(pool.take().block_id)
        seq.num_computed_tokens = h * self.block_size

    def _cached(self, seq: Sequence) -> tuple[int, list[list[Block]]]:
        # Capped below the last token, as BlockManager.cached_prefix is (its logits are needed).
        return self._reuse(seq, (seq.num_tokens - 1) // self.block_size if self.prefix_caching else 0)

    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, *self._cached(seq))

    def allocate(self, seq: Sequence) -> None:
        self._place(seq, *self._cached(seq))
        if seq.num_preemptions == 0:  # usage reports prompt tokens found cached, not a preempted sequence's own
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _shared(self, parent: Sequence, child: Sequence) -> tuple[int, list[list[Block]]]:
        limit = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        return self._reuse(child, limit, parent)

    def can_fork(self, parent: Sequence, child: Sequence) -> bool:
        return self._fits(child, *self._shared(parent, child))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share what the parent (or the prefix cache) holds of the prompt with a sibling."""
        self._place(child, *self._shared(parent, child))  # shared with a sibling: not "cached" in usage

    # -- running --------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new: int) -> bool:
        return all(p.can_append(seq, num_new) for p in self.pools)

    def append_slots(self, seq: Sequence, num_new: int) -> None:
        for p in self.pools:
            p.append_slots(seq, num_new)

    def commit(self, seq: Sequence) -> None:
        """After a step: publish the blocks `seq` has filled, then let a sliding group's out-of-window ones go."""
        for grp, pool in zip(self.layout.groups, self.pools, strict=True):
            pool.commit(seq)
            if grp.slides:
                pool.release_before(seq, grp.first_kept(seq.num_computed_tokens) // self.block_size)

    def free_seq(self, seq: Sequence) -> None:
        for p in self.pools:
            p.free_seq(seq)
