"""CUDABackend's start-up warm-ups and their batches: steps that write nothing (slots of -1) and read block 0, shaped
as the steps a first request would otherwise wait for Triton to compile."""

from __future__ import annotations

import logging
import time

import numpy as np

from backends.cuda import attention
from backends.cuda.runtime import torch
from backends.cuda.step_meta import partitions_for
from core.batch import Batch
from kernels_src import moe
from kernels_src.dsl.triton_target import int_class

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


def run_warm_up(backend, what: str, batches) -> None:
    """Run start-up `batches` (an iterable, built as they run) that write nothing, and log how many took how long. A
    warm-up: a failure is logged and serving goes on without it, those steps compiling when they first come. Each rank
    runs its own (allocate_kv is mirrored to the workers): none is mirrored again."""
    try:
        t0, n = time.perf_counter(), 0
        for batch in batches:
            backend._forward(batch, mirror=False)
            n += 1
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        log.info("%s warmed up: %d steps in %.1f s", what, n, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  (a warm-up: serving goes on without it)
        log.warning("warming up %s failed: %s: %s", what, type(e).__name__, e)


def warm_up_attention(backend, block_size: int) -> None:
    """Steps through the pieces whose block tables are 1, 8 and 16 blocks wide: the eager attention between the
    pieces is compiled for the table widths Triton tells apart (an integer argument equal to 1, a multiple of
    16, or neither), which a first request otherwise waited ~1 s for (an H200, an 8B model). Slots of -1 write
    nothing; the reads of block 0 are discarded."""
    def steps():
        for width in (1, 8, 16):
            n = min(width * block_size, backend.pieces.buckets[-1])
            yield one_sequence(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.full(n, -1, np.int32),
                               np.zeros((1, width), np.int32), backend.kv_layout().num_groups)

    run_warm_up(backend, "the attention of prefill steps", steps())


def warm_up_eager_steps(backend, max_positions: int) -> None:
    """The eager steps past the graphs' tokens (PIECEWISE_MAX_TOKENS up to max_step_tokens), with decode rows
    beside a prompt, compiled at start-up: a first wave of requests otherwise waited for them (an H200, an 8B
    model: a 2,048-token step of 48 sequences took 0.38 s to launch, docs/BENCHMARKS.md 2026-12-04). Sequence
    counts and token counts of each class Triton tells apart (a multiple of 16, or neither); nothing is
    written (slots of -1)."""
    groups = backend.kv_layout().num_groups
    run_warm_up(backend, "the eager steps beside decode rows", (
        mixed_batch(seqs, tokens, backend.block_size, max_positions, groups)
        for seqs, tokens in ((3, backend.max_step_tokens), (16, backend.max_step_tokens - 1))
        if tokens > seqs))  # smaller steps leave no prompt beside the decode rows


def decode_batch(rows: int, context: int, block_size: int, groups: int = 1, width: int | None = None) -> Batch:
    """A decode step of `rows` sequences `context` tokens long that writes nothing (slots -1) and reads block 0; its
    block tables `width` blocks wide (None: as many as the context needs; wider only adds unread entries)."""
    width = width or -(-context // block_size)
    slots, tables = np.full(rows, -1, np.int32), np.zeros((rows, width), np.int32)
    return Batch(np.zeros(rows, np.int32), np.full(rows, context - 1, np.int32), slots, tables,
                 np.full(rows, context, np.int32), np.arange(rows + 1, dtype=np.int32), np.arange(rows, dtype=np.int32),
                 group_slots=(slots,) * (groups - 1), group_tables=(tables,) * (groups - 1))


def decode_rows(max_seqs: int, experts: int = 0, top_k: int = 1) -> list[int]:
    """Row counts whose decode steps build every kernel a step's row count chooses: each count up to 16 (the GEMVs
    are built per row count, up to 8; the GGUF MMQ from 4; the dense GEMM from 9), then one of each integer class in
    each power-of-two bucket past it (the GEMMs' tiles go by M's next power of two), and of a MoE's slot counts
    (counts_by_class)."""
    return list(range(1, min(16, max_seqs) + 1)) + counts_by_class(16, max_seqs, experts, top_k)


def split_counts(most: int) -> list[int]:
    """Split-K partition counts up to `most` that build every decode kernel: 1 (no split), then, for each power of
    two p (the reduce's BLOCK_P, and the fused combine's, is the count's next power of two), one count of each
    integer class in p/2+1..p (the count is the kernels' integer `max_parts`)."""
    return [1, *counts_by_class(1, most)]


def table_widths(context: int, block_size: int) -> list[int]:
    """Block-table widths to warm up for a `context`: one. The kernels take the table's row stride, whose integer
    class (1, a multiple of 16, another) Triton tells apart, but an eager step pads its tables to a multiple of
    step_meta.TABLE_BUCKET blocks, so every step's stride is of one class (a list: the callers' loops stay)."""
    return [-(-context // block_size)]


def eager_decode_steps(runner, max_seqs: int, max_context: int, block_size: int, experts: int = 0,
                       top_k: int = 1) -> list[tuple[int, int, int]]:
    """(rows, context, table width) of the decode steps that build every kernel an eager decode of up to max_seqs
    sequences and max_context tokens launches. A row count's kernels outside attention: decode_rows (with a MoE's
    `experts` and `top_k`), a one-block context. The attention's depend on rows only through
    attention.decode_settings (tile, partition, fused reduce, grid cap), and on a step's partition count and table
    width by their integer classes: for each setting, at its fewest rows (the largest grid cap), every split_counts
    count with every table_widths width."""
    short = min(max_context, block_size)
    steps = [(rows, short, 1) for rows in decode_rows(max_seqs, experts, top_k)]
    settings: dict[tuple, tuple[int, int]] = {}  # (BLOCK_N, num_warps, fused, partition) -> (rows, most partitions)
    for rows in range(1, max_seqs + 1):
        block_n, num_warps, fused, partition, cap = attention.decode_settings(runner, rows)
        most = min(cap, partitions_for(max_context, partition))
        settings.setdefault((block_n, num_warps, fused, partition), (rows, most))
    for (*_, partition), (rows, most) in settings.items():
        for n in split_counts(most):
            context = short if n == 1 else min(max_context, n * partition)
            steps += [(rows, context, w) for w in table_widths(context, block_size) if (rows, context, w) not in steps]
    return steps


def warm_up_eager_decode(backend, max_context: int) -> None:
    """With CUDA graphs off, every decode kernel a serving step can launch, built at start-up (eager_decode_steps):
    a first step otherwise waited for Triton to compile (an H200, an 8B model at 4k: a step of 1 sequence took
    0.49 s to launch, then 16, 8 and 4; at 128 tokens a step of 16 took 0.73 s; measured 2026-12-04, with the graph
    capture's steps warmed up: an eager step's partition count and table width are any integer, not the graphs'
    powers of two and fixed width). Nothing is written (slots -1)."""
    groups, size = backend.kv_layout().num_groups, backend.block_size
    run_warm_up(backend, f"eager decode (up to {backend.max_num_seqs} sequences, contexts up to {max_context})", (
        decode_batch(rows, context, size, groups, width)
        for rows, context, width in eager_decode_steps(backend.runner, backend.max_num_seqs, max_context, size,
                                                       *moe_shape(backend))))


def prefill_steps(max_tokens: int, block_size: int, experts: int = 0, top_k: int = 1) -> list[tuple[int, int]]:
    """(prompt tokens, table width) of one-sequence steps that, beside the decode warm-up's row counts, build the
    kernels a prefill step chooses: a 2-token prompt with tables of each width class (the prefill attention's tiles
    do not depend on the tokens, its table stride's class does); each count from 3 up to 16 (a prompt's tokens are
    its linears' rows, the GEMVs and the small GEMMs are built per row count, and an eager decode step's rows are
    padded to a batch bucket, eager.padded_rows: a mixed step of 14 tokens has no decode step of 14 rows before it);
    then, past 16 tokens, one count of each integer class in each power-of-two bucket (the GEMMs' tiles go by M's
    next power of two; a MoE's slot counts too: counts_by_class)."""
    return [(min(2, max_tokens), w) for w in table_widths(1, block_size)] + [
        (n, -(-n // block_size)) for n in range(3, min(16, max_tokens) + 1)] + [
        (n, -(-n // block_size)) for n in counts_by_class(16, max_tokens, experts, top_k)]


def warm_up_eager_prefill(backend, max_positions: int) -> None:
    """With CUDA graphs off, prefill steps are eager at every token count: the prefill_steps prompts, and
    warm_up_eager_steps' decode rows beside a prompt, run at start-up. Nothing is written (slots -1); the reads of
    block 0 are discarded."""
    groups, size = backend.kv_layout().num_groups, backend.block_size
    run_warm_up(backend, f"eager prefill (up to {backend.max_step_tokens} tokens)", (
        one_sequence(np.zeros(n, np.int32), np.arange(n, dtype=np.int32) % max_positions, np.full(n, -1, np.int32),
                     np.zeros((1, width), np.int32), groups)
        for n, width in prefill_steps(backend.max_step_tokens, size, *moe_shape(backend))))
    warm_up_eager_steps(backend, max_positions)


def spread_batch(seqs: int, tokens: int, width: int, block_size: int, max_positions: int, groups: int = 1) -> Batch:
    """A step of `tokens` tokens over `seqs` sequences that writes nothing (slots -1) and reads block 0: the tokens
    spread evenly, each sequence a whole prompt but the first, a chunk ending `width` blocks in (its table as wide
    as that: core.batch.make_batch's width, the longest sequence's blocks). Needs width * block_size >= the longest
    sequence's tokens. Rope positions below `max_positions`."""
    lens = np.full(seqs, tokens // seqs, np.int32)
    lens[:tokens % seqs] += 1
    context = lens.copy()
    context[0] = width * block_size
    positions = np.concatenate([np.arange(c - n, c) for n, c in zip(lens, context, strict=True)]) % max_positions
    slots, tables = np.full(tokens, -1, np.int32), np.zeros((seqs, width), np.int32)
    ends = np.cumsum(lens).astype(np.int32)
    return Batch(np.zeros(tokens, np.int32), positions.astype(np.int32), slots, tables, context,
                 np.concatenate([[0], ends]).astype(np.int32), ends - 1,
                 group_slots=(slots,) * (groups - 1), group_tables=(tables,) * (groups - 1))


def moe_shape(backend) -> tuple[int, int]:
    """(routed experts, experts a token) of a MoE's config (Qwen-MoE, Mixtral, DeepSeek); (0, 1) of a dense one."""
    cfg = backend.model.config
    return getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "top_k", 1) or 1


def blocks(tokens: int, seqs: int, block_size: int) -> int:
    """The blocks of spread_batch's longest sequence, a whole prompt: its table's width."""
    longest = -(-tokens // seqs)
    return -(-longest // block_size)


def counts_by_class(first: int, most: int, experts: int = 0, top_k: int = 1) -> list[int]:
    """Counts past `first` up to `most` (of tokens, rows or partitions) whose steps build every kernel a step's count
    chooses: in each power-of-two bucket (the GEMMs' tiles go by M's next power of two) the largest count of each
    integer class Triton tells apart (1, a multiple of 16, another), and with experts (a MoE), of each class of the
    slot count tokens * top_k and of what else of it the MoE's kernels are built for (moe.slot_key: its side of each
    moe.slot_bounds bound, moe_align's block count's class)."""
    bounds = moe.slot_bounds(experts) if experts else ()

    def key(n: int) -> tuple:
        slots = n * top_k
        return (int_class(n), int_class(slots), *moe.slot_key(slots, experts, bounds)) if experts else (int_class(n),)

    out, p = [], 1
    while p // 2 < most:
        seen = set()
        for n in range(min(p, most), max(p // 2, first), -1):
            if key(n) not in seen:
                seen.add(key(n))
                out.append(n)
        p *= 2
    return sorted(out)


def graph_prefill_steps(first: int, most: int, max_seqs: int, block_size: int, experts: int = 0,
                        top_k: int = 1) -> list[tuple[int, int, int]]:
    """(sequences, tokens, table width) of the steps that build every kernel a prefill step past `first` tokens
    (the graphs' pieces) launches eagerly, with CUDA graphs on: each counts_by_class count; each decode_rows
    count of sequences (the logits' rows: the LM head's GEMV is built per row count, the decode graphs' captures
    cover their buckets only); paired up, the row counts past the token counts at the fewest tokens. Then tables of each
    width class (the prefill attention's table stride), where a step can have them: width 1 takes a block's tokens
    a sequence at most."""
    counts = counts_by_class(first, most, experts, top_k)
    if not counts:
        return []
    rows, steps = decode_rows(max_seqs), []
    for i in range(max(len(counts), len(rows))):
        n = counts[i] if i < len(counts) else counts[0]
        seqs = min(rows[i % len(rows)], n)
        steps.append((seqs, n, blocks(n, seqs, block_size)))
    n, seqs = counts[0], min(max_seqs, counts[0])
    need = blocks(n, seqs, block_size)  # at the most sequences
    widths = {int_class(w) for *_, w in steps}
    for w in table_widths(need * block_size, block_size):
        if int_class(w) not in widths:
            widths.add(int_class(w))
            steps.append((seqs, n, w))
    return steps


def warm_up_graph_prefill(backend, max_positions: int, first: int) -> None:
    """With CUDA graphs on, steps of more tokens than the pieces take (`first`) launch eagerly: the
    graph_prefill_steps run at start-up, several sequences each (an H200, Qwen3-30B-A3B Q4_K_M: a 4,096-token step
    of 64 sequences took 0.90 s to launch, 2026-12-04, after warm_up_eager_steps alone). Nothing is written (slots
    -1); the reads of block 0 are discarded."""
    groups, size = backend.kv_layout().num_groups, backend.block_size
    run_warm_up(backend, f"eager prefill steps past {first} tokens (up to {backend.max_step_tokens} tokens, "
                f"{backend.max_num_seqs} sequences)", (
        spread_batch(seqs, n, width, size, max_positions, groups)
        for seqs, n, width in graph_prefill_steps(first, backend.max_step_tokens, backend.max_num_seqs, size,
                                                  *moe_shape(backend))))
