"""Paged attention for prefill and chunked prefill (flat varlen queries over the paged cache): DSL kernel and host
launcher; the reference is `paged_attention_ref` in paged_attention.py (the `core.batch` contract).

Sequence b owns query tokens query_start[b]:query_start[b+1]; its i-th one sits at cache index
context_lens[b] - q_len + i and attends causally to cache indices 0..that one (its own K/V are already in the
cache). One program takes BLOCK_M rows of one KV head: rows are (token, query head of the group) pairs, token-major,
so the GROUP heads sharing a KV head read each K/V tile once. Keys are walked in BLOCK_N tiles up to the tile's
last query (causal), from its first query's window start (sliding window), with the online softmax of `attend`.
Decode tokens (q_len 1) are valid here too; paged_decode is the faster path when every sequence decodes.

The grid above depends on the batch (sequences x longest query), so a CUDA graph could not hold it. The mapped
kernels take a grid fixed by a capacity (`tile_capacity`: the most tiles any step of a token and a sequence bound
can have, x KV heads) and read each program's (sequence, tile) from a map the host writes each step
(`build_tile_map`); programs past the step's tiles do nothing. Same program, same results (as vLLM's unified
attention finds its sequence from device metadata).
"""

from __future__ import annotations

import numpy as np

from kernels_src import kv_fp8
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.paged_attend import CacheScales, attend
from kernels_src.paged_attention import NO_WINDOW, paged_attention_ref
from kernels_src.paged_cache_args import cache_strides, check_cache, quant_args


def paged_prefill_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start, out, scale, softcap, window,
                         q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride,
                         kv_tok_stride, kv_head_stride, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                         SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    prefill_program(q, k_cache, v_cache, None, block_tables, context_lens, query_start, out, scale, softcap, window,
                    q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                    kv_head_stride, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BS, SOFTCAP, PDL)


def paged_prefill_int8_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, query_start, out,
                              scale, softcap, window, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                              kv_block_stride, kv_tok_stride, kv_head_stride, sc_block_stride, sc_tok_stride,
                              sc_head_stride, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                              SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    """paged_prefill_kernel over an int8 cache (kv_int8's layout), dequantized in registers."""
    prefill_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                     sc_head_stride),
                    block_tables, context_lens, query_start, out, scale, softcap, window, q_stride, q_head_stride,
                    out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride, GROUP,
                    HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BS, SOFTCAP, PDL)


def paged_prefill_fp8_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, query_start, out,
                             scale, softcap, window, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                             kv_block_stride, kv_tok_stride, kv_head_stride, sc_block_stride, sc_tok_stride,
                             sc_head_stride, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                             SOFTCAP: tl.constexpr, PDL: tl.constexpr = False, FP8_CVT: tl.constexpr = False,
                             V_TOKEN_MINOR: tl.constexpr = False):
    """paged_prefill_kernel over an fp8 cache (kv_fp8's layout): e4m3 decoded in registers (FP8_CVT: by the FP8
    conversion), scaled per token."""
    prefill_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                     sc_head_stride, True, FP8_CVT, HEAD_DIM * BS * V_TOKEN_MINOR),
                    block_tables, context_lens, query_start, out, scale, softcap, window, q_stride, q_head_stride,
                    out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride, GROUP,
                    HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BS, SOFTCAP, PDL)


def paged_prefill_mapped_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start, tile_map, out, scale,
                                softcap, window, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                                kv_block_stride, kv_tok_stride, kv_head_stride, GROUP: tl.constexpr,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_N: tl.constexpr, BS: tl.constexpr, SOFTCAP: tl.constexpr,
                                PDL: tl.constexpr = False):
    """paged_prefill_kernel on a grid fixed by a capacity: each program's (sequence, tile) from `tile_map`."""
    prefill_program(q, k_cache, v_cache, None, block_tables, context_lens, query_start, out, scale, softcap, window,
                    q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                    kv_head_stride, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BS, SOFTCAP, PDL, tile_map)


def paged_prefill_mapped_int8_kernel(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens,
                                     query_start, tile_map, out, scale, softcap, window, q_stride, q_head_stride,
                                     out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                                     kv_head_stride, sc_block_stride, sc_tok_stride, sc_head_stride,
                                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                                     SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    """paged_prefill_mapped_kernel over an int8 cache (kv_int8's layout)."""
    prefill_program(q, k_cache, v_cache, CacheScales(k_scales, v_scales, sc_block_stride, sc_tok_stride,
                                                     sc_head_stride),
                    block_tables, context_lens, query_start, out, scale, softcap, window, q_stride, q_head_stride,
                    out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride, GROUP,
                    HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BS, SOFTCAP, PDL, tile_map)


def prefill_program(q, k_cache, v_cache, scales, block_tables, context_lens, query_start, out, scale, softcap, window,
                    q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride,
                    kv_head_stride, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BS, SOFTCAP, PDL, tile_map=None):
    """One (sequence, KV head, row tile) program of the prefill kernels (`scales` as attend takes them). With a
    `tile_map` the grid is (map entries, KV heads) and entry p names the program's (sequence, tile); a sequence of
    -1 is an unused entry, which reads and writes nothing."""
    if tile_map is None:
        b, kvh, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:  # the map is copied in from the host before the step: read before waiting on earlier kernels
        p, kvh = tl.program_id(0), tl.program_id(1)
        seq, tile = tl.load(tile_map + 2 * p), tl.load(tile_map + 2 * p + 1)
        b = tl.maximum(seq, 0)
    if PDL:  # q, the caches and the batch's tables may all be earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    q0 = tl.load(query_start + b)
    q_len = tl.load(query_start + b + 1) - q0
    if tile_map is not None:
        q_len = tl.where(seq >= 0, q_len, 0)  # no rows: no keys walked (hi = 0 below), every store masked
    ctx = tl.load(context_lens + b)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t, g = r // GROUP, r % GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    mask = (t < q_len)[:, None] & dmask[None, :]
    heads = kvh * GROUP + g
    qv = tl.load(q + (q0 + t)[:, None] * q_stride + heads[:, None] * q_head_stride + d[None, :], mask=mask,
                 other=0.0)
    qi = ctx - q_len + t
    first = ctx - q_len + tile * BLOCK_M // GROUP
    last = ctx - q_len + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    lo = tl.maximum(kv_fp8.window_start(first - window + 1, BS, scales), 0)
    hi = tl.where(first < ctx, last + 1, 0)  # tiles past the sequence's queries do nothing
    m, den, acc = attend(qv, qi, k_cache, v_cache, block_tables + b * bt_stride, kvh, lo, hi, scale, softcap, window,
                       kv_block_stride, kv_tok_stride, kv_head_stride, d, dmask, BLOCK_N, BS, SOFTCAP, scales)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(out + (q0 + t)[:, None] * out_stride + heads[:, None] * out_head_stride + d[None, :], acc / den[:, None],
             mask=mask)


def paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_start, scale: float, *,
                  sliding_window: int | None = None, softcap: float | None = None, out=None,
                  max_query_len: int | None = None, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                  k_scales=None, v_scales=None, tile_map=None, target: str = "numpy", pdl: bool | None = None):
    """Attention of flat varlen q [T, Hq, D] over the paged caches (see the module docstring); out [T, Hq, D].

    `max_query_len` bounds the per-sequence query counts (computed from query_start when not given). `k_scales`,
    `v_scales`: the caches are int8 codes with these group scales (kernels_src.kv_int8's layout) or e4m3 bytes
    (uint8) with these token scales (kernels_src.kv_fp8's). `tile_map`: a [capacity, 2] int32 array of
    `build_tile_map` for this block_m (`row_tile`): the grid is then (capacity, KV heads) whatever the batch (a CUDA
    graph's), and max_query_len is not read (16-bit and int8 caches only).
    """
    group, bs = check_cache(q, k_cache, v_cache)
    d = q.shape[2]
    out = empty(q, q.shape) if out is None else out
    block_d = max(16, tl.next_power_of_2(d))
    block_m, block_n = prefill_tiles(group, block_d, block_m, block_n)
    consts = dict(GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n, BS=bs,
                  SOFTCAP=bool(softcap))
    if tile_map is not None:
        grid, kernels, maps = (tile_map.shape[0], k_cache.shape[2]), (*MAPPED_KERNELS, None), (tile_map,)
    else:
        if max_query_len is None:
            max_query_len = int((query_start[1:] - query_start[:-1]).max()) if len(query_start) > 1 else 0
        grid, kernels, maps = (len(context_lens), k_cache.shape[2], tl.cdiv(max_query_len * group, block_m)), \
            (paged_prefill_kernel, paged_prefill_int8_kernel, paged_prefill_fp8_kernel), ()
    if 0 in grid:
        return out
    pdl = use_pdl(target, pdl)
    caches, fn, sc_strides, extra = quant_args(k_cache, v_cache, k_scales, v_scales, *kernels, target)
    if fn is None:
        raise ValueError("paged_prefill: no tile-mapped kernel for an fp8 cache (whole-step graphs leave such steps "
                         "to the pieces)")
    kern = compile(fn, target, num_warps=num_warps, launch_pdl=pdl, PDL=pdl, **consts, **extra)
    kern[grid](
        q, *caches, block_tables, context_lens, query_start, *maps, out, float(scale), float(softcap or 0.0),
        int(sliding_window or NO_WINDOW), elem_stride(q, 0), elem_stride(q, 1), elem_stride(out, 0),
        elem_stride(out, 1), elem_stride(block_tables, 0), *cache_strides(k_cache), *sc_strides)
    return out


# Shared memory the q tile and the K and V tiles may take (16-bit values): Triton 3.7 on this machine asks for
# (BLOCK_M + 2 BLOCK_N) * BLOCK_D * 2 bytes, and the H200's Triton 3.6 asked 1.67x that at MLA's 576-wide heads
# (655,872 bytes at 64 x 64 tiles, over the 232,448 an sm_90 block may have): a budget under half the limit.
SMEM_BUDGET = 100 * 1024


def prefill_tiles(group: int, block_d: int, block_m: int = 64, block_n: int = 64) -> tuple[int, int]:
    """BLOCK_M and BLOCK_N: a whole group of query heads a tile where the tiles fit SMEM_BUDGET (every head
    width up to 256), else halved (keys first, then rows, down to 16 each), since a tile may also hold part of
    a group: MLA's 576-wide latent heads (16 heads a group in V2-Lite, 128 in V3)."""
    block_m, block_n = max(16, tl.next_power_of_2(group), block_m), max(16, block_n)

    def fits() -> bool:
        return (block_m + 2 * block_n) * block_d * 2 <= SMEM_BUDGET

    while not fits() and block_n > 16:
        block_n //= 2
    while not fits() and block_m > 16:
        block_m //= 2
    return block_m, block_n


MAPPED_KERNELS = (paged_prefill_mapped_kernel, paged_prefill_mapped_int8_kernel)


def tile_key(q_heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(GQA group, row tile): which tile map a layer of these heads reads (one per key in a whole-step graph)."""
    return q_heads // kv_heads, row_tile(q_heads, kv_heads, head_dim)


def row_tile(q_heads: int, kv_heads: int, head_dim: int) -> int:
    """BLOCK_M that paged_prefill takes (at its default tiles) for these heads: the unit of a tile map's rows."""
    return prefill_tiles(q_heads // kv_heads, max(16, tl.next_power_of_2(head_dim)))[0]


def tile_capacity(max_tokens: int, max_seqs: int, group: int, block_m: int) -> int:
    """Map entries enough for any step of up to max_tokens query tokens in up to max_seqs sequences: each sequence
    adds at most one partial tile to the tokens' whole ones."""
    return tl.cdiv(max_tokens * group, block_m) + min(max_seqs, max_tokens)


def build_tile_map(query_start, group: int, block_m: int, capacity: int, out=None):
    """[capacity, 2] int32 (sequence, row tile) entries, sequence by sequence, each sequence's tiles in order; the
    rest (-1, 0), which do nothing. Written into `out` (a pinned host array) when given."""
    q_lens = np.diff(np.asarray(query_start, np.int64))
    tiles = -(-q_lens * group // block_m)
    n = int(tiles.sum())
    if n > capacity:
        raise ValueError(f"{n} attention tiles ({len(q_lens)} sequences, {int(q_lens.sum())} tokens) exceed the map's "
                         f"capacity of {capacity}")
    out = np.empty((capacity, 2), np.int32) if out is None else out
    out[:n, 0] = np.repeat(np.arange(len(q_lens)), tiles)
    out[:n, 1] = np.arange(n) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    out[n:] = (-1, 0)
    return out


paged_prefill_ref = paged_attention_ref
