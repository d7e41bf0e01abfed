"""A decode step's rotary embedding and KV-cache write inside the decode kernel: paged_attention's decode program
given a RopeIn. One launch a layer where rope_kv_write then paged_decode took two.

Why: at batch 1 every launch between two dependent kernels costs about a kernel's latency. x's int8 pass folded into
the norm took Q4_K_M from 398 to 432 tok/s on the H200 (docs/BENCHMARKS.md, 2026-12-04): ~1.3 us a launch. The
rope and cache write is one more such launch a layer, between the qkv projection and the decode.

- Each (sequence, KV head, partition) program rotates its own query heads. It uses rope_kv_write's fp32
  expressions (x1 c - x2 s, x2 c + x1 s) and rounds to q's dtype, so its q is the one the unfused decode loads. The
  rotation's cos and sin rows (the positions, from the host) are loaded before the PDL wait.
- The program whose partition holds the sequence's last key (this step's) rotates that key. It writes the key and
  the value into the cache at the step's slot (none for a negative slot), then waits at a barrier so that all its
  threads' stores are done before its loop reads the cache. No other program reads that key.
- Float caches only: the 8-bit caches' writes quantize, so their steps keep rope and the quantizing write. Targets
  whose barrier orders global memory only: Triton's (bar.sync) and the numpy interpreter (one program at a time).
  The SIMT renderers' Metal barrier fences threadgroup memory alone.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from kernels_src.dsl import tl
from kernels_src.paged_attend import Tile
from kernels_src.paged_attention import decode_program
from kernels_src.rope_kv_write import _check as check_rope_kv_write

TARGETS = ("triton", "triton-interpret", "numpy")
# Each program's first key tile read before the PDL wait (RopeIn.PREFETCH): its table entries come from the host and
# its keys and values from earlier steps, so none of them waits for the kernel before (the qkv projection); this
# step's key and value, written after the wait, are put into the tile from registers (patch_step_key). At batch 1 a
# decode program's keys are one or a few tiles, and its chain of dependent loads after the wait (q, then the table,
# then K and V) was most of its ~5 us a layer on the H200 (session 19's profile: 166 us a step of 2,290 for a Q4_K_M
# Llama-3-8B). Holding the tile across the wait takes registers (sm_90, Llama-3-8B's tile: 192 against 128: two
# programs an SM instead of decode_table.WAVES' four), so only grids that two programs an SM hold at once take it.
# The same numbers either way (tests/test_kernels_decode_rope.py); not yet timed: LLM_ENGINE_DECODE_PREFETCH=0 (never)
# or 1 (every grid).
PREFETCH_ENV = os.environ.get("LLM_ENGINE_DECODE_PREFETCH", "")
PREFETCH_PROGRAMS_AN_SM = 2


def prefetch_for(programs: int, sms: int) -> bool:
    """RopeIn.PREFETCH for a decode grid of `programs` programs on `sms` SMs (LLM_ENGINE_DECODE_PREFETCH's, if set)."""
    if PREFETCH_ENV in ("0", "1"):
        return PREFETCH_ENV == "1"
    return programs <= PREFETCH_PROGRAMS_AN_SM * sms


class RopeIn(NamedTuple):
    """This step's unrotated k and v [B, Hkv, D] (one token a sequence), their slots, the rotation's rows of cos
    and sin [*, HALF] (the positions, or a longrope spec's rows), and the strides."""

    k: object
    v: object
    slots: object
    rows: object
    cos: object
    sin: object
    k_stride: object
    k_head_stride: object
    v_stride: object
    v_head_stride: object
    table_stride: object
    HALF: int
    INTERLEAVED: bool
    PREFETCH: bool = False  # the first key tile read before the PDL wait (PREFETCH_ENV, above)


def _pairs(d, HALF, INTERLEAVED):
    """For each dim d: (it is its pair's first, its partner, its cos/sin column, it rotates: d < 2 HALF)."""
    if INTERLEAVED:
        first = d % 2 == 0
        return first, tl.where(first, d + 1, d - 1), d // 2, d < 2 * HALF
    first = d < HALF
    return first, tl.where(first, d + HALF, d - HALF), tl.where(first, d, d - HALF), d < 2 * HALF


def rotation(rope: RopeIn, b, d):
    """(cos, sin) of sequence b's row for each dim d (fp32, 0 past the rotary dims) and its slot."""
    _, _, col, rot = _pairs(d, rope.HALF, rope.INTERLEAVED)
    row = tl.load(rope.rows + b).to(tl.int32)
    c = tl.load(rope.cos + row * rope.table_stride + col, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(rope.sin + row * rope.table_stride + col, mask=rot, other=0.0).to(tl.float32)
    return c, s, tl.load(rope.slots + b).to(tl.int64)


def _rotated(rows, mask, d, c, s, rope: RopeIn):
    """The rows at pointers `rows` [R, 1] rotated (dims past 2 HALF as they are), in their own dtype."""
    first, partner, _, rot = _pairs(d, rope.HALF, rope.INTERLEAVED)
    raw = tl.load(rows + d[None, :], mask=mask, other=0.0)
    x = raw.to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    y = tl.where(first[None, :], x * c[None, :] - xp * s[None, :], x * c[None, :] + xp * s[None, :])
    return tl.where(rot[None, :], y, x).to(raw.dtype)


def write_kv(rope: RopeIn, cs, q_rows, qmask, b, kvh, d, dmask, ctx, lo, hi, k_cache, v_cache, kv_block_stride,
             kv_tok_stride, kv_head_stride, BS):
    """(q's rows `q_rows` [GROUP, 1] rotated, (this step's key and value rows [1, BLOCK_D], whether this program
    wrote them)); by the program whose keys [lo, hi) end at the context's last, that key (rotated) and value in the
    cache, stored before the program reads the cache."""
    c, s, slot = cs
    qv = _rotated(q_rows, qmask, d, c, s, rope)
    writes = (hi == ctx) & (lo < hi) & (slot >= 0)
    one = tl.zeros([1], tl.int32)[:, None]  # a [1, BLOCK_D] row
    wmask = (one == 0) & dmask[None, :] & writes
    kt = _rotated(rope.k + b * rope.k_stride + kvh * rope.k_head_stride + one, wmask, d, c, s, rope)
    at = (slot // BS) * kv_block_stride + (slot % BS) * kv_tok_stride + kvh * kv_head_stride + one + d[None, :]
    tl.store(k_cache + at, kt, mask=wmask)
    vt = tl.load(rope.v + b * rope.v_stride + kvh * rope.v_head_stride + one + d[None, :], mask=wmask, other=0.0)
    tl.store(v_cache + at, vt, mask=wmask)
    tl.debug_barrier()  # the key and value stored by every thread before any reads the cache
    return qv, (kt.to(k_cache.dtype.element_ty), vt.to(v_cache.dtype.element_ty), writes)


def patch_step_key(tile: Tile, step_kv, ctx) -> Tile:
    """A key tile loaded before this step's key and value were written (PREFETCH) with them put in at their index
    (ctx - 1), as a load after the write would have read them."""
    k, v, writes = step_kv
    col = (tile.toks == ctx - 1) & writes
    return tile._replace(kt=tl.where(col[None, :], tl.trans(k), tile.kt), vt=tl.where(col[:, None], v, tile.vt))


def paged_decode_rope_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, k, v,
                             slots, rows, cos, sin, scale, softcap, window, max_parts, q_stride, q_head_stride,
                             out_stride, out_head_stride, bt_stride, kv_block_stride, kv_tok_stride, kv_head_stride,
                             k_stride, k_head_stride, v_stride, v_head_stride, table_stride, GROUP: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_N: tl.constexpr, BS: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
                             SOFTCAP: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                             PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """paged_decode_kernel over float caches, q unrotated: the rope and cache write of rope_kv_write done here."""
    decode_program(q, k_cache, v_cache, None, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
                   softcap, window, max_parts, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                   kv_block_stride, kv_tok_stride, kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS,
                   PARTITION, SPLIT, SOFTCAP, PDL,
                   rope=RopeIn(k, v, slots, rows, cos, sin, k_stride, k_head_stride, v_stride, v_head_stride,
                               table_stride, HALF, INTERLEAVED, PREFETCH))


def paged_decode_rope_fused_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
                                   counters, k, v, slots, rows, cos, sin, scale, softcap, window, max_parts, q_stride,
                                   q_head_stride, out_stride, out_head_stride, bt_stride, kv_block_stride,
                                   kv_tok_stride, kv_head_stride, k_stride, k_head_stride, v_stride, v_head_stride,
                                   table_stride, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                                   PARTITION: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                                   HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_P: tl.constexpr = 1,
                                   PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """paged_decode_rope_kernel with the last partition combining (paged_decode_fused_kernel's `counters`)."""
    decode_program(q, k_cache, v_cache, None, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
                   softcap, window, max_parts, q_stride, q_head_stride, out_stride, out_head_stride, bt_stride,
                   kv_block_stride, kv_tok_stride, kv_head_stride, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BS,
                   PARTITION, SPLIT, SOFTCAP, PDL, counters, BLOCK_P,
                   rope=RopeIn(k, v, slots, rows, cos, sin, k_stride, k_head_stride, v_stride, v_head_stride,
                               table_stride, HALF, INTERLEAVED, PREFETCH))


# --- host side ---------------------------------------------------------------------------------------------------

def check_rope(q, k, v, k_cache, v_cache, slots, rows, cos, sin) -> None:
    """What paged_decode's `rope` must hold: rope_kv_write's arguments (k and v [B, Hkv, D] beside q [B, Hq, D] and
    the caches, contiguous head dims, a slot and a row a sequence, cos and sin [*, HALF] with 2 HALF <= D), cos and
    sin 2-D tables, a float cache."""
    check_rope_kv_write(q, k, v, k_cache, v_cache, slots, rows, cos, sin)
    if len(cos.shape) != 2:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: want equal [*, <= {q.shape[2] // 2}]")
    if str(k_cache.dtype).endswith(("int8", "uint8")):
        raise ValueError("the rope decode writes float caches only (8-bit caches quantize on their write)")
