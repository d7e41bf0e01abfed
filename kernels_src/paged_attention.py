"""Paged attention for decode (one query token per sequence), split over the context: DSL kernels, host launcher
and the numpy reference of the `core.batch` contract (shared with the prefill kernel in paged_prefill.py).

Caches are [num_blocks, block_size, Hkv, D]; sequence b's cache index j lives at block
`block_tables[b, j // block_size]`, offset `j % block_size`. One program takes one sequence, one KV head and every
query head sharing it (GQA: K and V are read once), padded to 16 rows so both products are `dot`s. Keys are
walked in tiles of BLOCK_N tokens (any multiple or fraction of the cache block size) gathered through the block
table, with an online softmax in the log2 domain. Split-K: the grid has `max_parts` partitions per (sequence, KV
head); each sequence's context is cut into partitions of PARTITION tokens, or into max_parts equal ones (multiples of
BLOCK_N) when it is longer than that, so one grid (one CUDA graph) serves every context. Each program writes its
partial (max, sum, acc) to scratch; a small reduce kernel combines them, or (the *_fused kernels, on targets with
atomics: decode_combine.py) the last program of each (sequence, KV head) to finish does. Programs past the context
hold no keys. A grid of one partition skips the scratch and the reduce.
"""

from __future__ import annotations

import numpy as np

from ir.interpreter import attend_cached
from kernels_src import e4m3, kv_fp8
from kernels_src.decode_combine import (
    FUSED_TILE,
    combine_block,
    combine_if_last,
    combine_rows,
    decode_counters,
    use_fused_reduce,
)
from kernels_src.dsl import Plans, compile, elem_stride, empty, int_class, signature, tl, use_pdl
from kernels_src.paged_attend import (  # noqa: F401  (decode's loop; re-exported)
    LOG2E,
    CacheScales,
    attend,
    dequantize_tiles,
    key_tile,
)
from kernels_src.paged_cache_args import cache_strides, check_cache, quant_args
from kernels_src.split_k import sm_count

NO_WINDOW = 1 << 30


def partition_len(ctx, max_parts, PARTITION, BLOCK_N):
    """Keys per split-K partition of a context: PARTITION, or a share of max_parts (rounded up to BLOCK_N) when the
    context is longer than max_parts * PARTITION. The reduce recomputes it: cdiv(ctx, plen) partitions hold keys."""
    step = max_parts * BLOCK_N
    return tl.maximum(PARTITION, (ctx + step - 1) // step * BLOCK_N)


def partition_keys(ctx, part, max_parts, PARTITION, BLOCK_N, SPLIT):
    """[lo, hi) of the context's keys that partition `part` takes (all of them unless SPLIT)."""
    if not SPLIT:
        return 0, ctx
    plen = partition_len(ctx, max_parts, PARTITION, BLOCK_N)
    return part * plen, tl.minimum(part * plen + plen, ctx)


def paged_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
                        softcap, window, max_parts, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                        kv_block_stride, kv_tok_stride, kv_head_stride, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr, BS: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
                        SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    decode_program(q, k_cache, v_cache, None, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
                   softcap, window, max_parts, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                   kv_block_stride, kv_tok_stride, kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS,
                   PARTITION, SPLIT, SOFTCAP, PDL)


def paged_decode_int8_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, out, part_m,
                             part_l, part_acc, scale, softcap, window, max_parts, q_stride, q_head_stride, out_stride,
                             out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride,
                             sc_block_stride, sc_tok_stride, sc_head_stride, GROUP: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_N: tl.constexpr, BS: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
                             SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    """paged_decode_kernel over an int8 cache (kv_int8's layout), dequantized in registers."""
    decode_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                    sc_head_stride),
                   block_tables, context_lens, out, part_m, part_l, part_acc, scale, softcap, window, max_parts,
                   q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                   kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS, PARTITION, SPLIT, SOFTCAP, PDL)


def paged_decode_fp8_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, out, part_m,
                            part_l, part_acc, scale, softcap, window, max_parts, q_stride, q_head_stride, out_stride,
                            out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride,
                            sc_block_stride, sc_tok_stride, sc_head_stride, GROUP: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_N: tl.constexpr, BS: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
                            SOFTCAP: tl.constexpr, PDL: tl.constexpr = False, FP8_CVT: tl.constexpr = False,
                            V_TOKEN_MINOR: tl.constexpr = False, FP8_MMA: tl.constexpr = False):
    """paged_decode_kernel over an fp8 cache (kv_fp8's layout): e4m3 decoded in registers (FP8_CVT: by the FP8
    conversion), scaled per token; FP8_MMA (V token-minor): the dots in e4m3 instead (paged_attend_fp8)."""
    decode_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                    sc_head_stride, True, FP8_CVT, HEAD_DIM * BS * V_TOKEN_MINOR,
                                                    FP8_MMA),
                   block_tables, context_lens, out, part_m, part_l, part_acc, scale, softcap, window, max_parts,
                   q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                   kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS, PARTITION, SPLIT, SOFTCAP, PDL)


# The same three with `counters` (int32, one a (sequence, KV head), zeroed once): the last partition of each pair to
# finish combines the partials (decode_combine.py), so no reduce kernel follows; BLOCK_P partitions a round of it.

def paged_decode_fused_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
                              counters, scale, softcap, window, max_parts, q_stride, q_head_stride, out_stride,
                              out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride,
                              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                              PARTITION: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                              BLOCK_P: tl.constexpr = 1, PDL: tl.constexpr = False):
    decode_program(q, k_cache, v_cache, None, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
                   softcap, window, max_parts, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                   kv_block_stride, kv_tok_stride, kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS,
                   PARTITION, SPLIT, SOFTCAP, PDL, counters, BLOCK_P)


def paged_decode_int8_fused_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, out, part_m,
                                   part_l, part_acc, counters, scale, softcap, window, max_parts, q_stride,
                                   q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride,
                                   kv_tok_stride, kv_head_stride, sc_block_stride, sc_tok_stride, sc_head_stride,
                                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                                   PARTITION: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                                   BLOCK_P: tl.constexpr = 1, PDL: tl.constexpr = False):
    decode_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                    sc_head_stride),
                   block_tables, context_lens, out, part_m, part_l, part_acc, scale, softcap, window, max_parts,
                   q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                   kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS, PARTITION, SPLIT, SOFTCAP, PDL,
                   counters, BLOCK_P)


def paged_decode_fp8_fused_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, out, part_m,
                                  part_l, part_acc, counters, scale, softcap, window, max_parts, q_stride,
                                  q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride,
                                  kv_tok_stride, kv_head_stride, sc_block_stride, sc_tok_stride, sc_head_stride,
                                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                                  PARTITION: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                                  BLOCK_P: tl.constexpr = 1, PDL: tl.constexpr = False,
                                  FP8_CVT: tl.constexpr = False,
                                  V_TOKEN_MINOR: tl.constexpr = False, FP8_MMA: tl.constexpr = False):
    decode_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                    sc_head_stride, True, FP8_CVT, HEAD_DIM * BS * V_TOKEN_MINOR,
                                                    FP8_MMA),
                   block_tables, context_lens, out, part_m, part_l, part_acc, scale, softcap, window, max_parts,
                   q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                   kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS, PARTITION, SPLIT, SOFTCAP, PDL,
                   counters, BLOCK_P)


def decode_program(q, k_cache, v_cache, scales, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
                   softcap, window, max_parts, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                   kv_block_stride, kv_tok_stride, kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS,
                   PARTITION, SPLIT, SOFTCAP, PDL, counters=None, BLOCK_P=1, rope=None):
    """One (sequence, KV head, partition) program of the decode kernels (`scales` as attend takes them; `counters`:
    the fused kernels'; `rope`: paged_decode_rope's RopeIn, q rotated here and this step's keys and values written
    by the program that reads them)."""
    b, kvh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    gmask, dmask = g < GROUP, d < HEAD_DIM
    heads = kvh * GROUP + g
    mask = gmask[:, None] & dmask[None, :]
    # The context's length comes from the host (copied in before the step's first kernel), so it is read before
    # waiting for the kernel that writes q and the caches: one dependent load off each layer's critical path.
    ctx = tl.load(context_lens + b)
    lo, hi = partition_keys(ctx, part, max_parts, PARTITION, BLOCK_N, SPLIT)
    keys_lo = tl.maximum(lo, kv_fp8.window_start(ctx - window, BS, scales))  # the first key read
    table = block_tables + b * bt_stride
    first = None
    if rope is not None:  # the rotation's rows come from the host too: cos and sin are loaded before the wait
        from kernels_src.paged_decode_rope import patch_step_key, rotation, write_kv

        cs = rotation(rope, b, d)
        if rope.PREFETCH:  # the first key tile: the host's table entries, earlier steps' keys and values (this
            # step's are patched in below)
            first = key_tile(k_cache, v_cache, table, kvh, keys_lo, hi, 0, kv_block_stride, kv_tok_stride,
                             kv_head_stride, d, dmask, BLOCK_N, BS)
    if PDL:  # q and the caches are earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    if rope is None:
        qv = tl.load(q + b * q_stride + heads[:, None] * q_head_stride + d[None, :], mask=mask, other=0.0)
    else:
        qv, step_kv = write_kv(rope, cs, q + b * q_stride + heads[:, None] * q_head_stride, mask, b, kvh, d, dmask,
                               ctx, lo, hi, k_cache, v_cache, kv_block_stride, kv_tok_stride, kv_head_stride, BS)
        first = None if first is None else patch_step_key(first, step_kv, ctx)
    qi = tl.full([BLOCK_G], ctx - 1, tl.int32)
    m, den, acc = attend(qv, qi, k_cache, v_cache, table, kvh, keys_lo, hi, scale, softcap, window, kv_block_stride,
                         kv_tok_stride, kv_head_stride, d, dmask, BLOCK_N, BS, SOFTCAP, scales, first)
    if SPLIT:
        row = (b * (tl.num_programs(1) * GROUP) + heads) * max_parts + part
        tl.store(part_m + row, m, mask=gmask)
        tl.store(part_l + row, den, mask=gmask)
        tl.store(part_acc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
        if counters is not None:  # the (sequence, KV head)'s last program to finish combines: no reduce kernel
            plen = partition_len(ctx, max_parts, PARTITION, BLOCK_N)
            n_parts = tl.minimum(tl.maximum((ctx + plen - 1) // plen, 1), max_parts)  # an empty context: 1
            head = kvh * GROUP
            combine_if_last(counters + b * tl.num_programs(1) + kvh, part, n_parts,
                            (b * (tl.num_programs(1) * GROUP) + head) * max_parts, part_m, part_l, part_acc,
                            max_parts, out + b * out_stride + head * out_head_stride, out_head_stride, d, dmask,
                            GROUP, HEAD_DIM, BLOCK_P)
    else:
        den = tl.where(den == 0.0, 1.0, den)  # an empty context gives zeros, not 0/0
        tl.store(out + b * out_stride + heads[:, None] * out_head_stride + d[None, :], acc / den[:, None], mask=mask)


def paged_decode_reduce_kernel(part_m, part_l, part_acc, context_lens, out, max_parts, out_stride, out_head_stride,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Combines a row's partials BLOCK_P partitions at a time (decode_combine.combine_rows)."""
    b, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    base = (b * tl.num_programs(1) + h) * max_parts
    ctx = tl.load(context_lens + b)  # the host's: read before the wait, off the chain of loads after it
    if PDL:  # the partials are paged_decode_kernel's output
        tl.wait_prior_grid()
        tl.launch_dependents()
    plen = partition_len(ctx, max_parts, PARTITION, BLOCK_N)
    n_parts = tl.minimum((ctx + plen - 1) // plen, max_parts)
    [o] = combine_rows(part_m, part_l, part_acc, base, 0, n_parts, (n_parts + BLOCK_P - 1) // BLOCK_P, d, dmask,
                       HEAD_DIM, 1, BLOCK_P)
    tl.store(out + b * out_stride + h * out_head_stride + d, o, mask=dmask)


# --- host side -------------------------------------------------------------------------------------------------

def num_partitions(max_context: int, partition: int) -> int:
    return max(1, tl.cdiv(int(max_context), partition))


def decode_grid(max_context: int, partition: int, max_parts: int | None, block_n: int) -> tuple[int, int, int]:
    """paged_decode's (key tile, at least 16; partition, rounded up to whole tiles; the grid's partitions)."""
    block_n = max(16, block_n)
    partition = tl.cdiv(partition, block_n) * block_n
    n = num_partitions(max_context, partition)
    return block_n, partition, min(n, max_parts or n)


def reduce_block(n_parts: int, block_d: int = 128) -> int:
    """Partitions the reduce combines per round of loads (decode_combine.combine_block for one head: 64 of a
    128-wide head, 16 of MLA's 512-wide latent)."""
    return combine_block(n_parts, 1, block_d)


def decode_workspace(q, n_parts: int) -> tuple:
    """Split-K scratch for q [B, Hq, D]: partial maxima and sums [B, Hq, P] and accumulators [B, Hq, P, D]."""
    n_seq, hq, d = q.shape
    return (empty(q, (n_seq, hq, n_parts), "float32"), empty(q, (n_seq, hq, n_parts), "float32"),
            empty(q, (n_seq, hq, n_parts, d), "float32"))


# paged_decode's arguments but the tensors' addresses -> _decode_plan's: an eager step's decisions, made once
_DECODE_PLANS = Plans()


def _decode_plan(q, k_cache, v_cache, context_lens, n_parts, block_n, partition, softcap, out, num_warps, k_scales,
                 v_scales, target, pdl, fused, counters, rope=None) -> tuple:
    """What paged_decode decides from shapes, strides and options: the decode's launch and its arguments after the
    pointers (before the table's stride and after it), fused, the reduce's launch (or None) and its arguments."""
    group, bs = check_cache(q, k_cache, v_cache)
    n_seq, hq, d = q.shape
    split = n_parts > 1
    fused = split and use_fused_reduce(target, fused)
    if fused and counters is not None and (counters.shape[0] < n_seq * k_cache.shape[2] or len(counters.shape) != 1):
        raise ValueError(f"counters {tuple(counters.shape)}: one flat int32 a (sequence, KV head), "
                         f"{n_seq * k_cache.shape[2]} at least")
    consts = dict(GROUP=group, HEAD_DIM=d, BLOCK_G=max(16, tl.next_power_of_2(group)),
                  BLOCK_D=max(16, tl.next_power_of_2(d)), BLOCK_N=block_n, BS=bs, PARTITION=partition,
                  SPLIT=split, SOFTCAP=bool(softcap))
    pdl = use_pdl(target, pdl)
    kernels = ((paged_decode_fused_kernel, paged_decode_int8_fused_kernel, paged_decode_fp8_fused_kernel) if fused
               else (paged_decode_kernel, paged_decode_int8_kernel, paged_decode_fp8_kernel))
    # the integers after the caches' strides: an 8-bit cache's scale strides, or the rope decode's k, v, cos strides
    _, fn, tail_ints, extra = quant_args(k_cache, v_cache, k_scales, v_scales, *kernels, target)
    if rope is not None:  # q rotated and the step's keys and values written by the decode (paged_decode_rope)
        from kernels_src import paged_decode_rope as pdr

        if target not in pdr.TARGETS:
            raise ValueError(f"target {target!r}: the rope decode needs a barrier over global memory ({pdr.TARGETS})")
        k, v, slots, rows, cos, sin, interleaved = rope
        pdr.check_rope(q, k, v, k_cache, v_cache, slots, rows, cos, sin)
        fn = pdr.paged_decode_rope_fused_kernel if fused else pdr.paged_decode_rope_kernel
        extra = {"HALF": cos.shape[1], "INTERLEAVED": bool(interleaved),
                 "PREFETCH": pdr.prefetch_for(n_seq * k_cache.shape[2] * n_parts, sm_count(q))}
        tail_ints = (elem_stride(k, 0), elem_stride(k, 1), elem_stride(v, 0), elem_stride(v, 1), elem_stride(cos, 0))
    if fused:
        extra["BLOCK_P"] = combine_block(n_parts, group, consts["BLOCK_D"], FUSED_TILE)
    if extra.get("V_TOKEN_MINOR") and e4m3.use_mma(target) and min(consts["BLOCK_D"], block_n) >= 32:
        extra["FP8_MMA"] = True  # both dots' K (D, then keys) at least an FP8 MMA's 32
    stages = e4m3.DECODE_STAGES if target == "triton" and "FP8_CVT" in extra else None
    kern = compile(fn, target, num_warps=num_warps, launch_pdl=pdl, num_stages=stages, PDL=pdl, **consts, **extra)
    outs = (hq * d, d) if out is None else (elem_stride(out, 0), elem_stride(out, 1))  # a new out is contiguous
    reduce = None if not split or fused else compile(
        paged_decode_reduce_kernel, target, num_warps=num_warps, launch_pdl=pdl, HEAD_DIM=d, BLOCK_D=consts["BLOCK_D"],
        PARTITION=partition, BLOCK_N=block_n, BLOCK_P=reduce_block(n_parts, consts["BLOCK_D"]), PDL=pdl)
    reduce = reduce and reduce.bind((n_seq, hq))
    return (kern.bind((n_seq, k_cache.shape[2], n_parts)), elem_stride(q, 0), elem_stride(q, 1), *outs), \
        (*cache_strides(k_cache), *tail_ints), fused, reduce, (n_parts, *outs)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, *, sliding_window: int | None = None,
                 softcap: float | None = None, out=None, max_context: int | None = None, partition: int = 512,
                 max_parts: int | None = None, block_n: int = 64, workspace=None, num_warps: int = 4,
                 k_scales=None, v_scales=None, target: str = "numpy", pdl: bool | None = None,
                 fused: bool | None = None, counters=None, rope=None):
    """Attention of q [B, Hq, D] (one token per sequence, the last of its context) over the paged caches.

    The grid has cdiv(max_context, partition) partitions (max_context: context_lens' maximum unless given, e.g. to
    keep the grid fixed under CUDA graphs), at most `max_parts`; a context longer than the grid's partitions of
    `partition` tokens is cut into that many longer ones, so any context is served by any grid.
    `workspace` is (m, den, acc) fp32 scratch [B, Hq, P] x2, [B, Hq, P, D], or a function of P that returns them
    (a runner's, kept between launches; None: made here). `k_scales`, `v_scales`: the caches
    are int8 codes with these group scales (kernels_src.kv_int8's layout) or e4m3 bytes (uint8) with these token
    scales (kernels_src.kv_fp8's). `fused` (None: decode_combine.use_fused_reduce): a split grid's last program of
    each (sequence, KV head) combines the partials, on `counters` (int32, B * Hkv at least, zero; None: made here).
    `rope` (k, v, slots, rows, cos, sin, interleaved): q is unrotated and this step's k and v [B, Hkv, D] are not yet
    in the (float) caches: the decode rotates q and k as rope_kv_write does and writes k and v at `slots` itself
    (kernels_src/paged_decode_rope.py); q is left as it was.
    """
    block_n, partition, n_parts = decode_grid(int(context_lens.max()) if max_context is None else max_context,
                                              partition, max_parts, block_n)
    bt_stride, key, fused = elem_stride(block_tables, 0), None, n_parts > 1 and use_fused_reduce(target, fused)
    if type(q) is not np.ndarray:  # a runner's: the plan is kept (any table width of a class)
        key = (signature(q, k_cache, v_cache, out, counters, k_scales, v_scales), block_tables.dtype,
               int_class(bt_stride), context_lens.dtype, scale, softcap, sliding_window, n_parts, partition, block_n,
               num_warps, target, pdl, fused, FUSED_TILE,
               None if rope is None else (signature(*rope[:6]), rope[6]))
    plan = _DECODE_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _decode_plan(q, k_cache, v_cache, context_lens, n_parts, block_n, partition, softcap, out, num_warps,
                            k_scales, v_scales, target, pdl, fused, counters, rope)
        if key is not None:
            _DECODE_PLANS.put(key, plan)
    (launch, *before), after, fused, reduce, reduce_ints = plan
    out = empty(q, q.shape) if out is None else out
    m, den, acc = (out, out, out) if n_parts == 1 else (  # out: unused
        workspace(n_parts) if callable(workspace) else workspace or decode_workspace(q, n_parts))
    if fused and counters is None:
        counters = decode_counters(q, q.shape[0] * k_cache.shape[2])
    caches = (k_cache, v_cache) if k_scales is None else (k_cache, v_cache, k_scales, v_scales)
    launch(q, *caches, block_tables, context_lens, out, m, den, acc, *([counters] if fused else []),
           *(() if rope is None else rope[:6]), float(scale), float(softcap or 0.0), int(sliding_window or NO_WINDOW),
           n_parts, *before, bt_stride, *after)
    if reduce is not None:
        reduce(m, den, acc, context_lens, out, *reduce_ints)
    return out


# --- reference -------------------------------------------------------------------------------------------------

def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start, scale: float,
                        sliding_window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """The `core.batch` contract over flat varlen q [T, Hq, D], in fp32 (decode: query_start = arange(B + 1)):
    the IR interpreter's own definition."""
    return attend_cached(q, k_cache, v_cache, block_tables, context_lens, query_start, scale=scale,
                         sliding_window=sliding_window, softcap=softcap)


def paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale: float, **kw) -> np.ndarray:
    return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, np.arange(q.shape[0] + 1), scale,
                               **kw)
