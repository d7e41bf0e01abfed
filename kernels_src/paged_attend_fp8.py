"""The decode's online softmax over an fp8 cache on FP8 tensor cores (e4m3.use_mma; LLM_ENGINE_FP8_MMA=1, off until
timed): `attend`'s loop (paged_attend.py) with both dots in e4m3, so the cache's codes go from shared memory into the
MMA with no per-element decode, which bounds the other fp8 loop (docs/BENCHMARKS.md 2026-12-04: 35% of copy where
the 16-bit cache's runs at 97%).

The products are transposed, because an FP8 MMA's tile is 64 rows a warpgroup and a decode program has 16 query rows
(Triton takes the 16-row dots as fp16 MMAs of converted tiles, which is the other loop): S^T [keys, rows] = K [keys,
D] @ q8^T, then acc^T [D, rows] += V^T [D, keys] @ P8 [keys, rows], V^T being the token-minor V's own layout
(kv_fp8.token_minor). q is rounded to two e4m3 terms once (q_terms: ~7 bits; one term's 3 bits gave outputs off by
up to 0.7 of their rms on keys with outlier channels), a scale a row; the weights of each tile to one, a scale a query
row, after the values' per-token scales are folded in (p * vs, as `attend` folds them; 3 bits, as FlashAttention-3's
FP8 path rounds them). Those roundings are the difference from `attend`; the sums stay fp32, and the denominator is
the unrounded weights'."""

from __future__ import annotations

from kernels_src import e4m3
from kernels_src.decode_combine import NEG_BIG
from kernels_src.dsl import tl
from kernels_src.paged_attend import LOG2E, tile_loops

TINY = 1e-30


def fp8_tile(codes):
    """e4m3 codes (any integer dtype holding 0-255) as an fp8 tile for a dot."""
    return codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


def rows_to_e4m3(x):
    """(e4m3 codes of x's rows, the rows' scales [rows]): each row over its largest |value| / 448 (1 for a row of
    zeros), rounded to nearest even."""
    top = tl.max(tl.abs(x), axis=1)
    s = tl.where(top > 0, top * (1.0 / e4m3.E4M3_MAX), 1.0)
    return e4m3.encode(x / s[:, None]), s


def q_terms(qv):
    """q as two e4m3 terms, q ~ hi * s_hi + lo * s_lo ([D, rows] tiles for the S^T dots, [rows] scales): the second
    rounds what the first leaves, so q keeps ~7 bits (e4m3 alone keeps 3, and the rounding of one element is
    multiplied by its key's, which outlier channels make large: SmolLM2's keys hold some 20x the rest)."""
    xf = qv.to(tl.float32)
    hi, s_hi = rows_to_e4m3(xf)
    lo, s_lo = rows_to_e4m3(xf - e4m3.decode_f32(hi) * (e4m3.FP16_SHIFT * s_hi)[:, None])
    return fp8_tile(tl.trans(hi)), s_hi, fp8_tile(tl.trans(lo)), s_lo


def attend_mma(qv, qi, k_cache, v_cache, table, kvh, lo, hi, scale, softcap, window, kv_block_stride, kv_tok_stride,
               kv_head_stride, d, dmask, BLOCK_N, BS, SOFTCAP, scales):
    """paged_attend.attend's (m, den, acc [rows, D]) over an fp8 cache with V token-minor (scales.v_head_stride),
    by e4m3 dots (module doc). BLOCK_N and D's tile: 32 or more (an FP8 dot's K)."""
    n = tl.arange(0, BLOCK_N)
    q_hi, s_hi, q_lo, s_lo = q_terms(qv)
    # the codes read as e4m3 where they lie: tiles so loaded go from shared memory into the MMA (a bitcast of
    # loaded bytes would route them through registers first)
    k_fp8, v_fp8 = k_cache.to(tl.pointer_type(tl.float8e4nv)), v_cache.to(tl.pointer_type(tl.float8e4nv))
    qk_scale = scale * LOG2E

    def body(it, m, den, acc, tail=True):
        toks = lo + it * BLOCK_N + n
        valid = toks < hi
        bvalid = toks // BS * BS < hi  # V loads whole blocks (16-byte vectors of 16 tokens), as kv_fp8.load_v
        blk = tl.load(table + toks // BS, mask=bvalid, other=0).to(tl.int64)
        off = blk * kv_block_stride + (toks % BS) * kv_tok_stride + kvh * kv_head_stride
        k8 = tl.load(k_fp8 + off[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        # a token past the last may hold any byte, NaN codes too, and 0 * NaN is NaN in the MMA: the last tile's
        # mask is the tokens', the others' whole blocks (16-byte vectors of 16 tokens, as kv_fp8.load_v)
        vt8 = tl.load(v_fp8 + (blk * kv_block_stride + kvh * scales.v_head_stride + toks % BS)[None, :]
                      + d[:, None] * BS, mask=dmask[:, None] & (valid if tail else bvalid)[None, :], other=0.0)
        soff = blk * scales.block_stride + (toks % BS) * scales.tok_stride + kvh * scales.head_stride
        ks = tl.load(scales.k + soff, mask=valid, other=0.0)
        vs = tl.load(scales.v + soff, mask=valid, other=0.0)
        s = (tl.dot(k8, q_hi) * s_hi[None, :] + tl.dot(k8, q_lo) * s_lo[None, :]) * ks[:, None]  # S^T [keys, rows]
        s = softcap * LOG2E * tl.tanh(s * (scale / softcap)) if SOFTCAP else s * qk_scale
        keep = valid[:, None] & (toks[:, None] <= qi[None, :]) & (toks[:, None] > qi[None, :] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[None, :])
        pv = p * vs[:, None]
        top = tl.max(pv, axis=0)
        top = tl.where(top > TINY, top, 1.0)  # 448 / top finite; weights all below TINY round to 0
        pc = fp8_tile(e4m3.encode(pv * (e4m3.E4M3_MAX / top)[None, :]))
        acc = acc * alpha[None, :] + tl.dot(vt8, pc) * (top * (1.0 / e4m3.E4M3_MAX))[None, :]
        return m_new, den * alpha + tl.sum(p, axis=0), acc

    rows = qv.shape[0]
    init = (tl.full([rows], NEG_BIG, tl.float32), tl.zeros([rows], tl.float32),
            tl.zeros([d.shape[0], rows], tl.float32))
    m, den, acc = tile_loops(lo, hi, BLOCK_N, body, init, whole_first=True)
    return m, den, tl.trans(acc)
