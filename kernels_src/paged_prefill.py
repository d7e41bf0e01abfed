"""Paged attention for prefill and chunked prefill (flat varlen queries over the paged cache): DSL kernel and host
launcher; the reference is `paged_attention_ref` in paged_attention.py (the `core.batch` contract).

Sequence b owns query tokens query_start[b]:query_start[b+1]; its i-th one sits at cache index
context_lens[b] - q_len + i and attends causally to cache indices 0..that one (its own K/V are already in the
cache). One program takes BLOCK_M rows of one KV head: rows are (token, query head of the group) pairs, token-major,
so the GROUP heads sharing a KV head read each K/V tile once. Keys are walked in BLOCK_N tiles up to the tile's
last query (causal), from its first query's window start (sliding window), with the online softmax of `attend`.
Decode tokens (q_len 1) are valid here too; paged_decode is the faster path when every sequence decodes.
"""

from __future__ import annotations

from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.paged_attention import NO_WINDOW, attend, cache_strides, check_cache, empty, paged_attention_ref


def paged_prefill_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start, out, scale, softcap, window,
                         q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride,
                         kv_tok_stride, kv_head_stride, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                         SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    b, kvh, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:  # q, the caches and the batch's tables may all be earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    q0 = tl.load(query_start + b)
    q_len = tl.load(query_start + b + 1) - q0
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
    lo = tl.maximum(first - window + 1, 0)
    hi = tl.where(first < ctx, last + 1, 0)  # tiles past the sequence's queries do nothing
    m, den, acc = attend(qv, qi, k_cache, v_cache, block_tables + b * bt_stride, kvh, lo, hi, scale, softcap, window,
                       kv_block_stride, kv_tok_stride, kv_head_stride, d, dmask, BLOCK_N, BS, SOFTCAP)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(out + (q0 + t)[:, None] * out_stride + heads[:, None] * out_head_stride + d[None, :], acc / den[:, None],
             mask=mask)


def paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_start, scale: float, *,
                  sliding_window: int | None = None, softcap: float | None = None, out=None,
                  max_query_len: int | None = None, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                  target: str = "numpy", pdl: bool | None = None):
    """Attention of flat varlen q [T, Hq, D] over the paged caches (see the module docstring); out [T, Hq, D].

    `max_query_len` bounds the per-sequence query counts (computed from query_start when not given).
    """
    group, bs = check_cache(q, k_cache, v_cache)
    d = q.shape[2]
    out = empty(q, q.shape) if out is None else out
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max()) if len(query_start) > 1 else 0
    block_m = max(16, tl.next_power_of_2(group), block_m)
    consts = dict(GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=max(16, tl.next_power_of_2(d)),
                  BLOCK_N=max(16, block_n), BS=bs, SOFTCAP=bool(softcap))
    n_tiles = tl.cdiv(max_query_len * group, block_m)
    if n_tiles == 0 or len(context_lens) == 0:
        return out
    pdl = use_pdl(target, pdl)
    kern = compile(paged_prefill_kernel, target, num_warps=num_warps, launch_pdl=pdl, PDL=pdl, **consts)
    kern[len(context_lens), k_cache.shape[2], n_tiles](
        q, k_cache, v_cache, block_tables, context_lens, query_start, out, float(scale), float(softcap or 0.0),
        int(sliding_window or NO_WINDOW), elem_stride(q, 0), elem_stride(q, 1), elem_stride(out, 0),
        elem_stride(out, 1), elem_stride(block_tables, 0), *cache_strides(k_cache))
    return out


paged_prefill_ref = paged_attention_ref
