"""The batches of CUDABackend's start-up warm-ups: steps that write nothing (slots of -1) and read block 0, shaped
as the steps a first request would otherwise wait for Triton to compile."""

from __future__ import annotations

import numpy as np

from core.batch import Batch


def one_sequence(ids, positions, slots, tables, groups: int = 1) -> Batch:
    """A prefill of one whole sequence, the same slots and table in every KV group's pool."""
    n, more = len(ids), groups - 1
    return Batch(ids, positions, slots, tables, np.array([n], np.int32), np.array([0, n], np.int32),
                 np.array([n - 1], np.int32), group_slots=(slots,) * more, group_tables=(tables,) * more)


def mixed_batch(seqs: int, tokens: int, block_size: int, max_positions: int, groups: int = 1) -> Batch:
    """A step of `tokens` tokens over `seqs` sequences that writes nothing: seqs - 1 decode rows (a token each, 17 in
    the cache) beside one prompt of the rest; block tables as wide as the prompt needs, all block 0 (the reads are
    discarded); rope positions below `max_positions`."""
    prompt = tokens - (seqs - 1)
    lens = np.array([1] * (seqs - 1) + [prompt], np.int32)
    context = np.array([17] * (seqs - 1) + [prompt], np.int32)
    positions = np.concatenate([np.full(seqs - 1, 16, np.int32), np.arange(prompt, dtype=np.int32)]) % max_positions
    slots, tables = np.full(tokens, -1, np.int32), np.zeros((seqs, -(-prompt // block_size)), np.int32)
    return Batch(np.zeros(tokens, np.int32), positions, slots, tables, context,
                 np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), (np.cumsum(lens) - 1).astype(np.int32),
                 group_slots=(slots,) * (groups - 1), group_tables=(tables,) * (groups - 1))
