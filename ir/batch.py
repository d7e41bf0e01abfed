"""The batch contract between the engine and every backend: one flat varlen step over a paged KV cache.

Sequence b owns query tokens `query_start[b]:query_start[b+1]` of the flat batch. After this step it
has `context_lens[b]` tokens in the cache; its i-th query token sits at cache index
`context_lens[b] - q_len_b + i` and attends causally to cache indices `0..` that index. Cache index j of
sequence b lives in slot `block_tables[b, j // block_size] * block_size + j % block_size`. Each new
token's k and v are written to `slot_mapping[t]` (a negative slot means padding: nothing is written).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ATTENTION_INPUTS = ("slot_mapping", "block_tables", "context_lens", "query_start")


@dataclass
class Batch:
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32 (rope positions)
    slot_mapping: np.ndarray  # [T] int32
    block_tables: np.ndarray  # [B, M] int32, unused entries -1
    context_lens: np.ndarray  # [B] int32
    query_start: np.ndarray  # [B + 1] int32
    logits_indices: np.ndarray  # [N] int32 rows of the batch that need logits

    def inputs(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in (
            "token_ids", "positions", "logits_indices", *ATTENTION_INPUTS)}

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def make_batch(
    chunks: Sequence[Sequence[int]],
    cached: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    all_logits: bool = False,
) -> Batch:
    """Build a batch from each sequence's new tokens, the count already in its cache, and its blocks.
    Logits are requested for each sequence's last new token (or for every token with all_logits)."""
    ids, pos, slots, starts, ctx, want = [], [], [], [0], [], []
    for toks, n_cached, table in zip(chunks, cached, block_tables, strict=True):
        for i, t in enumerate(toks):
            j = n_cached + i
            if j // block_size >= len(table):
                raise ValueError(f"sequence needs block {j // block_size} but owns {len(table)}")
            ids.append(t)
            pos.append(j)
            slots.append(table[j // block_size] * block_size + j % block_size)
        first = len(ids) - len(toks)
        want.extend(range(first, len(ids)) if all_logits else [len(ids) - 1])
        starts.append(len(ids))
        ctx.append(n_cached + len(toks))
    width = max((len(t) for t in block_tables), default=0)
    tables = np.full((len(block_tables), max(width, 1)), -1, dtype=np.int32)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = t
    i32 = lambda x: np.asarray(x, dtype=np.int32)
    return Batch(i32(ids), i32(pos), i32(slots), tables, i32(ctx), i32(starts), i32(want))
