"""CUDABackend's start-up warm-ups and their batches: steps that write nothing (slots of -1) and read block 0, shaped
as the steps a first request would otherwise wait for Triton to compile."""

from __future__ import annotations

import logging

import numpy as np

from backends.cuda.graphs import GraphKeys
from backends.cuda.runtime import torch
from core.batch import Batch

log = logging.getLogger(__name__)


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


def warm_up_attention(backend, block_size: int) -> None:
    """Steps through the pieces whose block tables are 1, 8 and 16 blocks wide: the eager attention between the
    pieces is compiled for the table widths Triton tells apart (an integer argument equal to 1, a multiple of
    16, or neither), which a first request otherwise waited ~1 s for (an H200, an 8B model). Slots of -1 write
    nothing; the reads of block 0 are discarded. A failure is logged: those steps still run, compiling then.
    Each rank runs its own (allocate_kv is mirrored to the workers): none is mirrored again."""
    try:
        for width in (1, 8, 16):
            n = min(width * block_size, backend.pieces.buckets[-1])
            backend._forward(one_sequence(np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                                          np.full(n, -1, np.int32), np.zeros((1, width), np.int32),
                                          backend.kv_layout().num_groups), mirror=False)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
    except Exception as e:  # noqa: BLE001  (a warm-up: serving goes on without it)
        log.warning("warming up the attention of prefill steps failed: %s: %s", type(e).__name__, e)


def warm_up_eager_steps(backend, max_positions: int) -> None:
    """The eager steps past the graphs' tokens (PIECEWISE_MAX_TOKENS up to max_step_tokens), with decode rows
    beside a prompt, compiled at start-up: a first wave of requests otherwise waited for them (an H200, an 8B
    model: a 2,048-token step of 48 sequences took 0.38 s to launch, docs/BENCHMARKS.md 2026-12-04). Sequence
    counts and token counts of each class Triton tells apart (a multiple of 16, or neither); nothing is
    written (slots of -1). Each rank runs its own, as warm_up_attention."""
    try:
        for seqs, tokens in ((3, backend.max_step_tokens), (16, backend.max_step_tokens - 1)):
            batch = mixed_batch(seqs, tokens, backend.block_size, max_positions, backend.kv_layout().num_groups)
            backend._forward(batch, mirror=False)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
    except Exception as e:  # noqa: BLE001  (a warm-up: serving goes on without it)
        log.warning("warming up the eager prefill steps failed: %s: %s", type(e).__name__, e)


def decode_batch(rows: int, context: int, block_size: int, groups: int = 1) -> Batch:
    """A decode step of `rows` sequences `context` tokens long that writes nothing (slots -1) and reads block 0."""
    slots, tables = np.full(rows, -1, np.int32), np.zeros((rows, -(-context // block_size)), np.int32)
    return Batch(np.zeros(rows, np.int32), np.full(rows, context - 1, np.int32), slots, tables,
                 np.full(rows, context, np.int32), np.arange(rows + 1, dtype=np.int32), np.arange(rows, dtype=np.int32),
                 group_slots=(slots,) * (groups - 1), group_tables=(tables,) * (groups - 1))


def warm_up_eager_decode(backend, max_context: int) -> None:
    """With CUDA graphs off, the decode steps their capture would have run (graphs.GraphKeys: each batch bucket at
    each power-of-two split-K partition count, and a one-block context), run at start-up: their kernels compile
    then, not inside a serving step (an H200, an 8B model at 4k: the first steps of 15, 8 and 4 sequences took
    0.57 s to launch, measured 2026-12-04). A bucket's kernels are those of every batch size it covers: the
    decode's partition and tile change only at its program counts, and partition counts and row counts matter
    only by power of two and Triton's integer classes (1, multiples of 16, others). Nothing is written (slots -1)."""
    keys = GraphKeys(backend.runner, backend.max_num_seqs, max_context)
    groups, size = backend.kv_layout().num_groups, backend.block_size
    steps = [(b, min(max_context, parts * backend.runner.decode_partition(b))) for b, parts in keys.all()]
    steps += [(b, min(max_context, size)) for b in keys.buckets]  # a table one block wide: an integer class of its own
    # rows one short of a bucket that is a multiple of 16: the other integer class of dense_gemm's M (9+ rows)
    steps += [(b - 1, min(max_context, size)) for b in keys.buckets if b >= 16 and b % 16 == 0]
    try:
        for rows, context in steps:
            backend._forward(decode_batch(rows, context, size, groups), mirror=False)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        log.info("eager decode steps warmed up: %d batch buckets up to %d, contexts up to %d", len(keys.buckets),
                 keys.buckets[-1], max_context)
    except Exception as e:  # noqa: BLE001  (a warm-up: serving goes on without it)
        log.warning("warming up the eager decode steps failed: %s: %s", type(e).__name__, e)
