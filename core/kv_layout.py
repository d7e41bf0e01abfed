"""The KV layout: which attention layers share a paged pool (a KV group), and how a KV budget is split among pools.

Full-attention layers form one group; each distinct sliding window forms a group of its own (vLLM's hybrid KV
cache manager does the same). Each group has its own pool of blocks and each sequence one block table per group: a
block id means the same tokens in every layer of its group. A sliding group keeps only the blocks its sequence's
future queries can read (a query at cache index p attends keys > p - window); the entries it has let go point at the
pool's null block, block 0, which a sliding pool never hands out, so a kernel that reads a masked-out entry reads
zeros, never another sequence's values or garbage (a NaN times a zero probability is still a NaN).

Group 0 is the full group when there is one, else the widest window: it needs the most blocks per sequence, keeps
the batch's original field names (`core.batch`) and is the pool every other one is sized against. A model whose
layers all attend alike has one group, held whole, exactly as before groups existed: a window that every layer
shares (mistral) is not used to free blocks.

How a budget is split (`KVLayout.pools`): a sliding group's sequence never holds more blocks than group 0's does
(it holds a suffix of the same tokens), nor more than `KVGroup.blocks_per_seq` (its window plus a step's chunk). So
group 0 gets N usable blocks and each sliding group min(N, max_num_seqs * blocks_per_seq) (+ its null block), with N
the largest that fits the budget: no sliding group can run out before group 0 does, at any context up to
max_model_len and any number of sequences up to max_num_seqs, and what a sliding group could never use goes to
group 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

NULL_BLOCK = 0  # a sliding pool's reserved block: the table entries a sequence has let go point at it


@dataclass(frozen=True)
class KVLimits:
    """The engine's limits that size the pools."""

    block_size: int
    max_num_seqs: int
    max_model_len: int
    step_tokens: int  # the most tokens one sequence computes in one step (its largest prefill chunk)


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention, every token kept
    layers: tuple[int, ...]

    @property
    def slides(self) -> bool:
        return self.window is not None

    def first_kept(self, position: int) -> int:
        """The first cache index that a query at `position`, or any later one, reads."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    def blocks_per_seq(self, limits: KVLimits) -> int:
        """The most blocks one sequence holds: its whole context, or (sliding) the window's keys before a step's
        first query plus the step's chunk, one block more where they straddle block edges."""
        bs = limits.block_size
        whole = -(-limits.max_model_len // bs)
        if self.window is None:
            return whole
        return min(whole, -(-(self.window + limits.step_tokens) // bs) + 1)


class LayerCache(NamedTuple):
    """What one attention layer caches per token: `heads` keys of key_dim and as many values of value_dim; or, with
    values_in_keys (multi-head latent attention's latent), the keys alone, each key's first value_dim elements
    being its value: one tensor, kv_lora_rank + rope dims a token."""

    heads: int
    key_dim: int
    value_dim: int
    values_in_keys: bool = False

    @property
    def elements(self) -> int:
        """Cached elements per token."""
        return self.heads * (self.key_dim + (0 if self.values_in_keys else self.value_dim))


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_of: tuple[int, ...]  # layer -> its group
    shapes: tuple[LayerCache, ...]  # layer -> what its cache holds

    @classmethod
    def from_layers(cls, windows: Sequence[int | None], shapes: Sequence[tuple]) -> KVLayout:
        """The layout of attention layers 0..n-1 with these windows (None: full attention) and cache shapes
        (LayerCache, or its fields as a tuple)."""
        if len(windows) != len(shapes):
            raise ValueError(f"{len(windows)} windows for {len(shapes)} attention layers")
        distinct = set(windows)
        if len(distinct) <= 1:
            order: list[int | None] = [None]  # one group: held whole
            group_of = (0,) * len(windows)
        else:
            order = sorted(distinct, key=lambda w: (w is not None, -(w or 0)))  # full first, then widest
            group_of = tuple(order.index(w) for w in windows)
        groups = tuple(KVGroup(w, tuple(i for i, g in enumerate(group_of) if g == n)) for n, w in enumerate(order))
        return cls(groups, group_of, tuple(LayerCache(*s) for s in shapes))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group_bytes(self, group: int, block_size: int, itemsize: int) -> int:
        """Bytes of K and V (or a latent) of one block of `group`'s pool (every layer of the group)."""
        return block_size * itemsize * sum(self.shapes[i].elements for i in self.groups[group].layers)

    def pools(self, blocks0: int, limits: KVLimits) -> list[int]:
        """Each pool's size in blocks (a sliding pool's null block included) when group 0 has `blocks0` usable
        blocks: the split rule of the module docstring."""
        out = []
        for g, grp in enumerate(self.groups):
            usable = blocks0 if g == 0 else min(blocks0, limits.max_num_seqs * grp.blocks_per_seq(limits))
            out.append(usable + grp.slides)
        return out

    def pools_for_budget(self, budget: int, block_bytes: Sequence[int], limits: KVLimits) -> list[int]:
        """The pools of the largest group-0 size whose blocks (of `block_bytes` each, per group) fit `budget`; at
        least one usable block a pool."""
        def cost(n: int) -> int:
            return sum(p * b for p, b in zip(self.pools(n, limits), block_bytes, strict=True))

        lo, hi = 1, max(1, budget // block_bytes[0])  # cost grows with n: the largest n with cost(n) <= budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
        return self.pools(lo, limits)
