"""The online-softmax loop over paged KV that decode (paged_attention.py) and prefill (paged_prefill.py) share:
`attend` walks a block table's keys in tiles for a program's query rows, over float, int8 (kv_int8.py) or fp8
(kv_fp8.py) caches; CacheScales carries a quantized cache's scales as it reads them."""

from __future__ import annotations

from typing import NamedTuple

from kernels_src import e4m3, kv_fp8, kv_int8
from kernels_src.decode_combine import NEG_BIG
from kernels_src.dsl import tl

LOG2E = 1.4426950408889634


class CacheScales(NamedTuple):
    """A quantized cache's scales as `attend` reads them (pointers and their block, token and head strides):
    int8 codes with a scale per group of kv_int8.GROUP values, or (fp8) e4m3 codes with one per token and head."""

    k: object
    v: object
    block_stride: object
    tok_stride: object
    head_stride: object
    fp8: bool = False
    cvt: bool = False  # fp8: decode by the FP8 conversion (e4m3.convert), not integer ops
    v_head_stride: int = 0  # fp8: V's codes token-minor (kv_fp8.token_minor), heads this far apart (D * BS); 0: as K's
    mma: bool = False  # fp8 with V token-minor: dots in e4m3 (paged_attend_fp8.attend_mma)


class Tile(NamedTuple):
    """A key tile as `attend` reads it: its cache indices and which are in [lo, hi), their blocks, K^T [BLOCK_D,
    BLOCK_N] and V [BLOCK_N, BLOCK_D] (the cache's codes)."""

    toks: object
    valid: object
    blk: object
    kt: object
    vt: object


def key_tile(k_cache, v_cache, table, kvh, lo, hi, it, kv_block_stride, kv_tok_stride, kv_head_stride, d, dmask,
             BLOCK_N, BS, scales=None, tail=True) -> Tile:
    """Tile `it` of the cache indices [lo, hi): the table entries, then K and V (the rope decode may load its first
    one before waiting for the kernel before it: paged_decode_rope.PREFETCH)."""
    toks = lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = toks < hi
    tok_minor = scales is not None and scales.v_head_stride  # fp8's token-minor V (kv_fp8.load_v)
    bvalid = toks // BS * BS < hi if tok_minor else valid  # its vectors' mask: whole blocks
    blk = tl.load(table + toks // BS, mask=bvalid, other=0).to(tl.int64)
    off = blk * kv_block_stride + (toks % BS) * kv_tok_stride + kvh * kv_head_stride
    # V is loaded with K (both addresses are known once the table entries are in): where loads issue in program
    # order (Metal, CUDA C, a Triton loop left unpipelined) the two round trips overlap instead of V's waiting
    # behind the QK dot. Triton's sm_90 pipeliner already issues both as cp.async, either way.
    kt = tl.load(k_cache + off[None, :] + d[:, None], mask=dmask[:, None] & valid[None, :], other=0.0)
    if tok_minor:
        vt = kv_fp8.load_v(v_cache, blk * kv_block_stride + kvh * scales.v_head_stride, toks, bvalid, d, dmask, BS,
                           valid if tail else None)
    else:
        vt = tl.load(v_cache + off[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    return Tile(toks, valid, blk, kt, vt)


def attend(qv, qi, k_cache, v_cache, table, kvh, lo, hi, scale, softcap, window, kv_block_stride, kv_tok_stride,
           kv_head_stride, d, dmask, BLOCK_N, BS, SOFTCAP, scales=None, first=None):
    """Online softmax of query rows qv [M, BLOCK_D] (cache index qi [M]) over cache indices [lo, hi): (m, den, acc).
    `scales`: None for float caches, else CacheScales: int8 tiles are dequantized in registers to q's dtype before
    their dots; fp8 tiles are decoded (exactly, times 2^-8; whole with scales.cvt) and their per-token scales applied
    to the scores (keys) and to the probabilities (values), one multiply a token instead of one an element.
    `first`: tile 0 as key_tile gave it (loaded earlier by the caller; float caches): the loop starts at tile 1."""
    if scales is not None and scales.mma:
        from kernels_src.paged_attend_fp8 import attend_mma  # it builds on this module's loop (tile_loops)

        return attend_mma(qv, qi, k_cache, v_cache, table, kvh, lo, hi, scale, softcap, window, kv_block_stride,
                          kv_tok_stride, kv_head_stride, d, dmask, BLOCK_N, BS, SOFTCAP, scales)
    rows = qv.shape[0]
    qk_scale = scale * LOG2E
    dot_type = qv.dtype
    if scales is not None and scales.cvt and e4m3.F16_DOTS and qv.dtype == tl.bfloat16:  # saturating, not inf
        dot_type = tl.float16
        qv = tl.minimum(tl.maximum(qv.to(tl.float32), -e4m3.FP16_MAX), e4m3.FP16_MAX).to(tl.float16)

    def body(it, m, den, acc, tail=True, loaded=None):
        toks, valid, blk, kt, vt = loaded or key_tile(k_cache, v_cache, table, kvh, lo, hi, it, kv_block_stride,
                                                      kv_tok_stride, kv_head_stride, d, dmask, BLOCK_N, BS, scales,
                                                      tail)
        fp8 = scales is not None and scales.fp8
        if fp8:
            soff = blk * scales.block_stride + (toks % BS) * scales.tok_stride + kvh * scales.head_stride
            ks = tl.load(scales.k + soff, mask=valid, other=0.0)
            # p * vs is rounded to q's dtype for the PV dot: times 2^8 it stays clear of fp16's subnormals either way
            vs = tl.load(scales.v + soff, mask=valid, other=0.0) * e4m3.FP16_SHIFT
            if scales.cvt:  # the values themselves, in the dots' dtype (bf16 q: fp16 with F16_DOTS, above)
                kt, vt = e4m3.convert(kt, dot_type), e4m3.convert(vt, dot_type)
            else:
                ks = ks * e4m3.FP16_SHIFT
                kt, vt = e4m3.decode_f16(kt).to(qv.dtype), e4m3.decode_f16(vt).to(qv.dtype)
        elif scales is not None:
            kt, vt = dequantize_tiles(kt, vt, scales, blk, toks % BS, kvh, d, dmask, valid, qv.dtype)
        s = tl.dot(qv, kt)
        if fp8:
            s = s * ks[None, :]
        s = softcap * LOG2E * tl.tanh(s * (scale / softcap)) if SOFTCAP else s * qk_scale
        keep = valid[None, :] & (toks[None, :] <= qi[:, None]) & (toks[None, :] > qi[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        pv = p * vs[None, :] if fp8 else p
        return m_new, den * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(pv.to(vt.dtype), vt)

    init = (tl.full([rows], NEG_BIG, tl.float32), tl.zeros([rows], tl.float32),
            tl.zeros([rows, d.shape[0]], tl.float32))
    start = 0
    if first is not None:  # an empty range's tile is all masked: it leaves the carry as it was
        if scales is not None:
            raise ValueError("attend: a tile loaded ahead is a float cache's")
        init, start = body(0, *init, loaded=first), 1
    m, den, acc = tile_loops(lo, hi, BLOCK_N, body, init, scales is not None and scales.v_head_stride, start)
    if scales is not None and scales.cvt:  # whole values times vs * 2^8: the 2^8 comes off once, after the loop
        acc = acc * (1.0 / e4m3.FP16_SHIFT)
    return m, den, acc


def tile_loops(lo, hi, BLOCK_N, body, init, whole_first=False, start=0):
    """`body(it, *carry[, tail])` over the key tiles of [lo, hi) from tile `start`: the final carry. whole_first (a
    token-minor V): the whole tiles (no token past hi) in a loop of their own, called with tail False, so only the
    last one clears the V bytes past the context."""
    n_iter = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    if not whole_first:
        return tl.fori_loop(start, n_iter, body, init)
    n_full = tl.maximum(hi - lo, 0) // BLOCK_N
    init = tl.fori_loop(0, n_full, lambda it, *carry: body(it, *carry, False), init)
    return tl.fori_loop(n_full, n_iter, body, init)


def dequantize_tiles(kt, vt, scales, blk, tok, kvh, d, dmask, valid, dtype):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] int8 tiles times their group scales, as `dtype`."""
    soff = blk * scales.block_stride + tok * scales.tok_stride + kvh * scales.head_stride
    grp = d // kv_int8.GROUP
    ks = tl.load(scales.k + soff[None, :] + grp[:, None], mask=dmask[:, None] & valid[None, :], other=0.0)
    vs = tl.load(scales.v + soff[:, None] + grp[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    return (kt.to(tl.float32) * ks).to(dtype), (vt.to(tl.float32) * vs).to(dtype)
