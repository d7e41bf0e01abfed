"""The split-K decode's "last partition combines" tail (CUDA's threadFenceReduction pattern): each program of a
(sequence, KV head) writes its partial (max, sum, acc), then counts itself done on that pair's counter with one
acquire-release atomic at GPU scope; the program that sees every other one done reads all the partials, writes the
output and sets the counter back to 0, so the next launch (a CUDA graph replay too) finds it zeroed. One kernel a
layer instead of the decode kernel and paged_decode_reduce_kernel: at batch 1 the reduce's launch was most of its
~6.5 us a layer (issues 13 and 14).

Only targets with atomics take it (FUSED_TARGETS: Triton's); the SIMT ones (C, CUDA C, Metal) keep the separate
reduce kernel. Off by default: on the H200 (2026-12-04, docs/BENCHMARKS.md) its graph-replay tests passed but it
saved nothing end to end (phi-3-mini bf16 batch 1 421 -> 423 tok/s, Llama-3-8B bf16 251 -> 251, Q4_K_M 398 -> 389):
with PDL the reduce's launch already overlapped the decode's tail. LLM_ENGINE_FUSED_REDUCE=1 turns it on for Triton.
"""

from __future__ import annotations

import os

from kernels_src.dsl import tl

NEG_BIG = -1.0e30  # running maxima start finite: rows with every key masked stay NaN-free
FUSED_TARGETS = ("triton", "triton-interpret")  # targets with atomics
FUSED_ENV = os.environ.get("LLM_ENGINE_FUSED_REDUCE")  # read once: eager steps launch per layer
FUSED_DEFAULT = FUSED_ENV == "1"
FUSED_REFUSED = FUSED_ENV == "0"  # said outright: eager steps keep the reduce kernel too (backends/cuda/eager.py)
# fp32 partials one round of a combine loads: 64 partitions of a 128-wide head (the reduce kernel: 118 registers on
# sm_90). A batch-1 decode at 4k has 64 partitions: one round instead of four dependent ones (Triton does not
# pipeline these loops)
COMBINE_TILE = 64 * 128
# The fused combine's (all of a program's heads a round): on sm_90 Llama-3-8B's batch-1 grid (4 heads of 128, 64
# partitions) takes 2 rounds of 32 partitions in 118 registers, at most the 128 that keep 4 programs an SM resident
# (decode_table.WAVES); rounds of 16 took 128, of 64 spilled
FUSED_TILE = 128 * 128


def use_fused_reduce(target: str, fused: bool | None = None) -> bool:
    """Whether a split-K decode on `target` combines its partials in its last program (None: where the target has
    atomics, when LLM_ENGINE_FUSED_REDUCE=1). True on a target without atomics is an error."""
    if fused is None:
        return target in FUSED_TARGETS and FUSED_DEFAULT
    if fused and target not in FUSED_TARGETS and target != "numpy":
        raise ValueError(f"target {target!r} has no atomics: its decode keeps the separate reduce kernel")
    return fused


def combine_block(max_parts: int, heads: int, block_d: int, tile: int | None = None) -> int:
    """Partitions of each of `heads` heads of block_d that one round of a combine loads: all of the grid's, up to
    `tile` (COMBINE_TILE) values in all."""
    fit = 1 << max(0, ((tile or COMBINE_TILE) // (heads * block_d)).bit_length() - 1)  # a power of two
    return min(fit, tl.next_power_of_2(max(1, max_parts)))


def decode_counters(like, n: int):
    """n zeroed int32 counters next to `like` (numpy or torch): one a (sequence, KV head) of the largest grid. Made
    once (per runner, per benchmark): the kernels leave them at 0."""
    import numpy as np

    if isinstance(like, np.ndarray):
        return np.zeros(n, np.int32)
    import torch

    return torch.zeros(n, dtype=torch.int32, device=like.device)


def combine_step(part_m, part_l, part_acc, base, parts, n_parts, d, dmask, HEAD_DIM, m, den, acc):
    """(m, den, acc) of one head after the partials of `parts` [BLOCK_P] (those below n_parts) at scratch rows
    base + parts: the running max, the sum and the accumulator rescaled to it, as attend's online softmax."""
    pmask = parts < n_parts
    mp = tl.load(part_m + base + parts, mask=pmask, other=NEG_BIG)
    lp = tl.load(part_l + base + parts, mask=pmask, other=0.0)
    ap = tl.load(part_acc + (base + parts)[:, None] * HEAD_DIM + d[None, :], mask=pmask[:, None] & dmask[None, :],
                 other=0.0)
    m_new = tl.maximum(m, tl.max(mp, axis=0))
    alpha, beta = tl.exp2(m - m_new), tl.exp2(mp - m_new)
    return m_new, den * alpha + tl.sum(lp * beta, axis=0), acc * alpha + tl.sum(ap * beta[:, None], axis=0)


def combine_rows(part_m, part_l, part_acc, base, stride, n_parts, rounds, d, dmask, HEAD_DIM, ROWS, BLOCK_P):
    """The outputs [BLOCK_D] of ROWS heads from their partials (head r's at scratch rows base + r * stride ..
    + n_parts - 1), BLOCK_P partitions of every head a round of loads (`rounds` of them: 0 gives zeros). The heads
    share each round, so their loads are in flight together; one round covers a short context (a loop of one
    partition per load waited on each load in turn, the slowest part of a batch-1 decode)."""
    p = tl.arange(0, BLOCK_P)

    def body(it, *carry):
        out = ()
        for r in tl.static_range(ROWS):
            out += combine_step(part_m, part_l, part_acc, base + r * stride, it * BLOCK_P + p, n_parts, d, dmask,
                                HEAD_DIM, *carry[3 * r:3 * r + 3])
        return out

    init = (tl.full((), NEG_BIG, tl.float32), tl.zeros((), tl.float32), tl.zeros([d.shape[0]], tl.float32)) * ROWS
    carry = tl.fori_loop(0, rounds, body, init)
    # an empty context gives zeros, not 0/0
    return [carry[3 * r + 2] / tl.where(carry[3 * r + 1] == 0.0, 1.0, carry[3 * r + 1]) for r in range(ROWS)]


def combine_if_last(counter, part, n_parts, base, part_m, part_l, part_acc, max_parts, out, out_head_stride, d,
                    dmask, GROUP, HEAD_DIM, BLOCK_P):
    """After this program stored its partials: count it done at `counter` (partitions 0..n_parts-1 count; the
    others hold no keys) and, in the last of them, combine the n_parts partials of each of its GROUP heads (scratch
    rows base + head * max_parts + partition) into out + head * out_head_stride."""
    # A release orders only the atomic's own thread's writes (Triton runs a scalar atomic on thread 0): the barrier
    # first makes every thread's partial part of what it releases. Triton broadcasts the atomic's result through
    # shared memory behind a barrier of its own; the second one keeps the acquire ahead of every thread's reads
    # whatever that lowering does.
    tl.debug_barrier()
    counts = part < n_parts
    done = tl.atomic_add(counter, 1, mask=counts, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = counts & (done == n_parts - 1)
    rounds = tl.where(last, (n_parts + BLOCK_P - 1) // BLOCK_P, 0)  # every program but the last runs none
    # 2-d tiles a head (a [heads, partitions, dim] tile took 161 registers on sm_90 where the decode takes 96)
    outs = combine_rows(part_m, part_l, part_acc, base, max_parts, n_parts, rounds, d, dmask, HEAD_DIM, GROUP,
                        BLOCK_P)
    for h, o in enumerate(outs):
        tl.store(out + h * out_head_stride + d, o, mask=last & dmask)
    tl.store(counter, 0, mask=last)
