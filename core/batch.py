"""The batch contract between the engine and every backend: one flat varlen step over a paged KV cache.

Sequence b owns query tokens `query_start[b]:query_start[b+1]` of the flat batch. After this step it
has `context_lens[b]` tokens in the cache; its i-th query token sits at cache index
`context_lens[b] - q_len_b + i` and attends causally to cache indices `0..` that index. Cache index j of
sequence b lives in slot `block_tables[b, j // block_size] * block_size + j % block_size`. Each new
token's k and v are written to `slot_mapping[t]` (a negative slot means padding: nothing is written).
"""

from __future__ import annotations

import itertools
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
    # Overlapped steps (backends with `chains_steps`): token t is the one the previous step sampled for its row
    # prev_rows[t], still on the device (token_ids holds a placeholder there); -1: token_ids holds it.
    prev_rows: np.ndarray | None = None

    def inputs(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in (
            "token_ids", "positions", "logits_indices", *ATTENTION_INPUTS)}

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the shape decode-only kernels and compiled steps take)."""
        return self.num_tokens > 0 and bool(np.all(np.diff(self.query_start) == 1))


def make_batch(
    chunks: Sequence[Sequence[int]],
    cached: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    all_logits: bool = False,
) -> Batch:
    """Build a batch from each sequence's new tokens, the count already in its cache, and its blocks.
    Logits are requested for each sequence's last new token (or for every token with all_logits).

    Vectorized: the engine builds one of these every step, and a per-token Python loop cost ~1 us a token."""
    n_seqs = len(chunks)
    if not (len(cached) == len(block_tables) == n_seqs):
        raise ValueError(f"{n_seqs} chunks, {len(cached)} cached counts and {len(block_tables)} block tables")
    lens = np.fromiter((len(c) for c in chunks), np.int64, n_seqs)
    starts = np.zeros(n_seqs + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    total = int(starts[-1])
    ids = np.fromiter(itertools.chain.from_iterable(chunks), np.int64, total)
    owned = np.fromiter((len(t) for t in block_tables), np.int64, n_seqs)
    tables = np.full((n_seqs, max(int(owned.max(initial=0)), 1)), -1, dtype=np.int32)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = t
    n_cached = np.asarray(cached, dtype=np.int64).reshape(n_seqs)
    seq_of = np.repeat(np.arange(n_seqs), lens)
    pos = n_cached[seq_of] + np.arange(total) - starts[:-1][seq_of]
    blk = pos // block_size
    short = np.flatnonzero(blk >= owned[seq_of])
    if len(short):
        t = short[0]
        raise ValueError(f"sequence needs block {blk[t]} but owns {owned[seq_of[t]]}")
    slots = tables[seq_of, blk].astype(np.int64) * block_size + pos % block_size
    want = np.arange(total) if all_logits else starts[1:] - 1
    i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return Batch(i32(ids), i32(pos), i32(slots), tables, i32(n_cached + lens), i32(starts), i32(want))
