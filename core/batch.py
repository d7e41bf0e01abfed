"""The batch contract between the engine and every backend: one flat varlen step over a paged KV cache.

Sequence b owns query tokens `query_start[b]:query_start[b+1]` of the flat batch. After this step it
has `context_lens[b]` tokens in the cache; its i-th query token sits at cache index
`context_lens[b] - q_len_b + i` and attends causally to cache indices `0..` that index. Cache index j of
sequence b lives in slot `block_tables[b, j // block_size] * block_size + j % block_size`. Each new
token's k and v are written to `slot_mapping[t]` (a negative slot means padding: nothing is written).

KV groups (`core.kv_layout`): a model whose layers form several groups has one pool, so one slot mapping and one
set of block tables, per group. `slot_mapping` and `block_tables` are group 0's (a one-group model has nothing
else); `group_slots[g - 1]` and `group_tables[g - 1]` are group g's, with the same meaning over its own pool. A
sliding group's tables keep every entry positional (index j // block_size); the entries of blocks that no query of
the step reads hold the pool's null block.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ATTENTION_INPUTS = ("slot_mapping", "block_tables", "context_lens", "query_start")


def group_input_names(group: int) -> tuple[str, str]:
    """The names Batch.inputs() gives group g's (g >= 1) slot mapping and block tables."""
    return f"slot_mapping.{group}", f"block_tables.{group}"


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
    group_slots: tuple[np.ndarray, ...] = ()  # [T] int32 each: groups 1.. (see the module docstring)
    group_tables: tuple[np.ndarray, ...] = ()  # [B, M] int32 each

    @property
    def num_groups(self) -> int:
        return 1 + len(self.group_slots)

    def kv_group(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(slot mapping, block tables) of one KV group."""
        if group == 0:
            return self.slot_mapping, self.block_tables
        return self.group_slots[group - 1], self.group_tables[group - 1]

    def inputs(self) -> dict[str, np.ndarray]:
        out = {k: getattr(self, k) for k in ("token_ids", "positions", "logits_indices", *ATTENTION_INPUTS)}
        for g in range(1, self.num_groups):
            out.update(zip(group_input_names(g), self.kv_group(g), strict=True))
        return out

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
    group_tables: Sequence[Sequence[Sequence[int]]] = (),
) -> Batch:
    """Build a batch from each sequence's new tokens, the count already in its cache, and its blocks (group 0's;
    `group_tables[g - 1]` holds every sequence's table of group g, for a model of several KV groups).
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
    n_cached = np.asarray(cached, dtype=np.int64).reshape(n_seqs)
    seq_of = np.repeat(np.arange(n_seqs), lens)
    pos = n_cached[seq_of] + np.arange(total) - starts[:-1][seq_of]
    blk = pos // block_size
    i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731

    def place(seq_tables: Sequence[Sequence[int]], group: int) -> tuple[np.ndarray, np.ndarray]:
        if len(seq_tables) != n_seqs:
            raise ValueError(f"{n_seqs} chunks but {len(seq_tables)} block tables of KV group {group}")
        owned = np.fromiter((len(t) for t in seq_tables), np.int64, n_seqs)
        tables = np.full((n_seqs, max(int(owned.max(initial=0)), 1)), -1, dtype=np.int32)
        for b, t in enumerate(seq_tables):
            tables[b, : len(t)] = t
        short = np.flatnonzero(blk >= owned[seq_of])
        if len(short):
            t = short[0]
            raise ValueError(f"sequence needs block {blk[t]} but owns {owned[seq_of[t]]} (KV group {group})")
        return i32(tables[seq_of, blk].astype(np.int64) * block_size + pos % block_size), tables

    slots, tables = place(block_tables, 0)
    groups = [place(t, g) for g, t in enumerate(group_tables, 1)]
    want = np.arange(total) if all_logits else starts[1:] - 1
    return Batch(i32(ids), i32(pos), slots, tables, i32(n_cached + lens), i32(starts), i32(want),
                 group_slots=tuple(s for s, _ in groups), group_tables=tuple(t for _, t in groups))


def pad_decode(batch: Batch, rows: int) -> Batch:
    """A decode batch of `rows` sequences: `batch` (one token a sequence) and padding sequences after it, each a
    token 0 at position 0 with a negative slot (nothing written) and an empty context (nothing read), as a CUDA
    graph's padding rows are. Its logits_indices are batch's: no padding row's logits are asked for."""
    n = batch.num_tokens
    if rows <= n:
        return batch
    pad = rows - n

    def more(a: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([a, np.full(pad, fill, a.dtype)])

    def wider(t: np.ndarray) -> np.ndarray:
        return np.concatenate([t, np.full((pad, t.shape[1]), -1, t.dtype)])

    return Batch(more(batch.token_ids, 0), more(batch.positions, 0), more(batch.slot_mapping, -1),
                 wider(batch.block_tables), more(batch.context_lens, 0),
                 np.concatenate([batch.query_start, batch.query_start[-1] + np.arange(1, pad + 1, dtype=np.int32)]),
                 batch.logits_indices, None if batch.prev_rows is None else more(batch.prev_rows, -1),
                 tuple(more(s, -1) for s in batch.group_slots), tuple(wider(t) for t in batch.group_tables))
