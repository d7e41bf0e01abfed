"""Multi-head latent attention (DeepSeek-V2/V3's MLA) for decode over the paged latent cache: DSL kernel, host
launcher and numpy reference.

Each token's cache entry is one latent `[latent (rank) | rope key (rope)]` shared by every query head; the query
is the absorbed one, q [B, H, rank + rope] (q_nope @ W_UK joined with q_rope). A score is q . entry over the full
width, the value is the entry's first `rank` elements: out [B, H, rank] = softmax(q . K * scale) @ K[:, :rank].
At V3's sizes (128 heads, 512 + 64) one program per KV head, as paged_decode has, would hold all 128 heads' rows
at width 576; here a program takes BLOCK_H heads and one split-K partition, and loads each key tile once for its
heads, in chunks of BLOCK_R dims plus one of the rope part: the chunks meet q in the score dots and, the rank
part kept, meet the probabilities in the output dots (the tile is its own value tile, and no rope-part sums are
computed for nothing). Partitions follow paged_attention's rules (partition_len, a grid of at most `max_parts`,
so one grid serves every context under a CUDA graph), and its reduce kernel combines the partials.
"""

from __future__ import annotations

import numpy as np

from kernels_src.decode_combine import NEG_BIG
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.paged_attend import LOG2E
from kernels_src.paged_attention import (
    empty,
    num_partitions,
    paged_decode_reduce_kernel,
    partition_keys,
    reduce_block,
)


def mla_decode_kernel(q, cache, block_tables, context_lens, out, part_m, part_l, part_acc, scale, max_parts,
                      q_stride, q_head_stride, out_stride, out_head_stride, bt_stride, c_block_stride, c_tok_stride,
                      HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                      PARTITION: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    b, hg, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < HEADS
    r, e, n = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_N)
    chunks = tl.cdiv(RANK, BLOCK_R)
    dims = [c * BLOCK_R + r for c in tl.static_range(chunks)]  # the rank part's chunks, then the rope part's
    dmasks = [dc < RANK for dc in dims]
    emask = e < ROPE
    if PDL:  # q, the cache and the batch's tables may all be earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    qrow = q + b * q_stride + heads[:, None] * q_head_stride
    qs = [tl.load(qrow + dc[None, :], mask=hmask[:, None] & dm[None, :], other=0.0)
          for dc, dm in zip(dims, dmasks, strict=True)]
    q_rope = tl.load(qrow + RANK + e[None, :], mask=hmask[:, None] & emask[None, :], other=0.0)
    ctx = tl.load(context_lens + b)
    lo, hi = partition_keys(ctx, part, max_parts, PARTITION, BLOCK_N, SPLIT)
    table = block_tables + b * bt_stride
    qk_scale = scale * LOG2E

    def body(it, m, den, *acc):
        toks = lo + it * BLOCK_N + n
        valid = toks < hi
        blk = tl.load(table + toks // BS, mask=valid, other=0).to(tl.int64)
        row = cache + (blk * c_block_stride + (toks % BS) * c_tok_stride)[:, None]  # [BLOCK_N, 1]: one latent a key
        k_rope = tl.load(row + RANK + e[None, :], mask=valid[:, None] & emask[None, :], other=0.0)
        s = tl.dot(q_rope, tl.trans(k_rope))
        keys = []
        for dc, dm, qc in zip(dims, dmasks, qs, strict=True):
            kc = tl.load(row + dc[None, :], mask=valid[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
            s = tl.dot(qc, tl.trans(kc), s)
            keys.append(kc)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        pv = p.to(keys[0].dtype)
        acc = [a * alpha[:, None] + tl.dot(pv, kc) for a, kc in zip(acc, keys, strict=True)]
        return (m_new, den * alpha + tl.sum(p, axis=1), *acc)

    init = (tl.full([BLOCK_H], NEG_BIG, tl.float32), tl.zeros([BLOCK_H], tl.float32),
            *[tl.zeros([BLOCK_H, BLOCK_R], tl.float32) for _ in dims])
    m, den, *acc = tl.fori_loop(0, (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N, body, init)
    if SPLIT:
        prow = (b * HEADS + heads) * max_parts + part
        tl.store(part_m + prow, m, mask=hmask)
        tl.store(part_l + prow, den, mask=hmask)
        for dc, dm, a in zip(dims, dmasks, acc, strict=True):
            tl.store(part_acc + prow[:, None] * RANK + dc[None, :], a, mask=hmask[:, None] & dm[None, :])
    else:
        den = tl.where(den == 0.0, 1.0, den)  # an empty context gives zeros, not 0/0
        orow = out + b * out_stride + heads[:, None] * out_head_stride
        for dc, dm, a in zip(dims, dmasks, acc, strict=True):
            tl.store(orow + dc[None, :], a / den[:, None], mask=hmask[:, None] & dm[None, :])


# --- host side -------------------------------------------------------------------------------------------------

def check_latent(q, cache, rank: int) -> tuple[int, int]:
    """(rope width, cache block size) after checking q [B, H, rank + rope] against cache [blocks, bs, 1, same]."""
    if len(q.shape) != 3 or len(cache.shape) != 4 or cache.shape[2] != 1 or q.shape[2] != cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the latent cache {tuple(cache.shape)} "
                         "(q [B, H, D] over [blocks, block_size, 1, D])")
    if not 0 < rank <= q.shape[2]:
        raise ValueError(f"rank {rank} must be 1..{q.shape[2]} (the latent's leading part)")
    if elem_stride(q, 2) != 1 or elem_stride(cache, 3) != 1:
        raise ValueError("latent dims must be contiguous")
    return q.shape[2] - rank, cache.shape[1]


def mla_workspace(q, rank: int, n_parts: int) -> tuple:
    """Split-K scratch for q [B, H, .]: partial maxima and sums [B, H, P] and accumulators [B, H, P, rank]."""
    n_seq, heads = q.shape[:2]
    return (empty(q, (n_seq, heads, n_parts), "float32"), empty(q, (n_seq, heads, n_parts), "float32"),
            empty(q, (n_seq, heads, n_parts, rank), "float32"))


def mla_tiles(rank: int, rope: int, split: bool = True, block_h: int = 16, block_n: int | None = None,
              block_r: int | None = None) -> dict:
    """Constexprs of a configuration: BLOCK_H heads, BLOCK_N keys a tile (32 split, 16 in one partition), rank
    chunks of BLOCK_R (32), the rope part padded to a power of two >= 16. At V3's 512 + 64 with 4 warps these build
    for sm_90 at 190 registers (split) and 168 (one partition), spilling nothing, two programs an SM; chunks of 64
    or 128, or 64 keys, take all 255 registers and spill in one of the two (tests/test_kernels_mla.py)."""
    return dict(BLOCK_H=max(16, block_h), BLOCK_R=max(16, block_r or min(32, tl.next_power_of_2(rank))),
                BLOCK_E=max(16, tl.next_power_of_2(max(rope, 1))), BLOCK_N=max(16, block_n or (32 if split else 16)))


def mla_decode(q, cache, block_tables, context_lens, scale: float, rank: int, *, out=None,
               max_context: int | None = None, partition: int = 512, max_parts: int | None = None,
               block_h: int = 16, block_n: int | None = None, block_r: int | None = None, workspace=None,
               num_warps: int = 4, target: str = "numpy", pdl: bool | None = None):
    """MLA of q [B, H, rank + rope] (one token per sequence, the last of its context) over the latent cache
    [blocks, block_size, 1, rank + rope]: out [B, H, rank]. Grid and partitions as paged_attention.paged_decode
    (max_context fixes the grid under CUDA graphs); `workspace` is mla_workspace's (m, den, acc)."""
    rope, bs = check_latent(q, cache, rank)
    n_seq, heads = q.shape[:2]
    out = empty(q, (n_seq, heads, rank)) if out is None else out
    split_n = mla_tiles(rank, rope, True, block_h, block_n, block_r)["BLOCK_N"]  # what partitions are multiples of
    partition = tl.cdiv(partition, split_n) * split_n
    n_parts = num_partitions(int(context_lens.max()) if max_context is None else max_context, partition)
    n_parts = min(n_parts, max_parts or n_parts)
    split = n_parts > 1
    tiles = mla_tiles(rank, rope, split, block_h, block_n, block_r)
    m, den, acc = (workspace or mla_workspace(q, rank, n_parts)) if split else (out, out, out)  # unused if one
    pdl = use_pdl(target, pdl)
    kern = compile(mla_decode_kernel, target, num_warps=num_warps, launch_pdl=pdl, HEADS=heads, RANK=rank, ROPE=rope,
                   BS=bs, PARTITION=partition, SPLIT=split, PDL=pdl, **tiles)
    kern[n_seq, tl.cdiv(heads, tiles["BLOCK_H"]), n_parts](
        q, cache, block_tables, context_lens, out, m, den, acc, float(scale), n_parts, elem_stride(q, 0),
        elem_stride(q, 1), elem_stride(out, 0), elem_stride(out, 1), elem_stride(block_tables, 0),
        elem_stride(cache, 0), elem_stride(cache, 1))
    if split:
        block_d = max(16, tl.next_power_of_2(rank))
        red = compile(paged_decode_reduce_kernel, target, num_warps=num_warps, launch_pdl=pdl, HEAD_DIM=rank,
                      BLOCK_D=block_d, PARTITION=partition, BLOCK_N=tiles["BLOCK_N"],
                      BLOCK_P=reduce_block(n_parts, block_d), PDL=pdl)
        red[n_seq, heads](m, den, acc, context_lens, out, n_parts, elem_stride(out, 0), elem_stride(out, 1))
    return out


# --- reference -------------------------------------------------------------------------------------------------

def mla_decode_ref(q, cache, block_tables, context_lens, scale: float, rank: int) -> np.ndarray:
    """Sequence by sequence in fp32: its latents gathered through the block table, softmax(q K^T scale) K[:, :rank]."""
    q = np.asarray(q, np.float32)
    cache = np.asarray(cache, np.float32)
    bs = cache.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], rank), np.float32)
    for b, n_ctx in enumerate(np.asarray(context_lens)):
        if n_ctx == 0:
            continue
        j = np.arange(n_ctx)
        keys = cache[np.asarray(block_tables)[b, j // bs], j % bs, 0]  # [ctx, rank + rope]
        s = q[b] @ keys.T * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b] = (p / p.sum(axis=1, keepdims=True)) @ keys[:, :rank]
    return out
