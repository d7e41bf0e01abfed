"""fp32 -> Q2_K / Q3_K / Q4_K / Q5_K / Q6_K super-blocks: ports of ggml-quants.c's quantize_row_q*_K_ref (what
llama-quantize runs without an importance matrix), vectorized over super-blocks. Each takes x (n, 256) float32 and
returns (n, type_size) uint8 blocks in ggml's byte layout."""

from __future__ import annotations

import numpy as np

from ir.formats.kquant_search import make_q3_quants, make_qkx2_quants, make_qx_quants
from ir.formats.quant_common import (
    F32,
    GROUP_MAX_EPS,
    abs_max_signed,
    f16_bytes,
    f16_round,
    nearest_int,
    pack_crumbs,
    pack_nibbles,
    seqsum,
)


def _requant(x: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray | None, lo: int, hi: int,
             offset: int = 0) -> np.ndarray:
    """The final pass of every k-quant: with the stored (fp16-rounded) group scales d and mins dm, each value's
    quant again, nearest_int((x + dm) / d) (or x / d) clamped to lo..hi, plus offset; groups whose d is 0 keep the
    search's L."""
    with np.errstate(all="ignore"):
        v = (x + dm[..., None]) / d[..., None] if dm is not None else x / d[..., None]
        q = np.clip(nearest_int(v), lo, hi)
    return np.where((d != 0)[..., None], q + offset, L)


def _max_over_groups(v: np.ndarray) -> np.ndarray:
    """max(0, v[:, j]...) as ggml's `if (v > max) max = v` from 0."""
    return np.maximum(v.max(axis=1), F32(0))


def _affine_groups(x: np.ndarray, group: int, nmax: int, rmin: float, nstep: int, use_mad: bool, weights):
    """make_qkx2_quants on every group of a super-block: (L (n, 256/group, group), scales, mins)."""
    n, g = x.shape[0], 256 // group
    xg = x.reshape(n * g, group)
    L, sc, mn = make_qkx2_quants(xg, weights(xg), nmax, rmin, 0.1, nstep, use_mad)
    return L.reshape(n, g, group), sc.reshape(n, g), mn.reshape(n, g)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    L, scales, mins = _affine_groups(x, 16, 3, -0.5, 15, True, np.abs)
    max_scale, max_min = _max_over_groups(scales), _max_over_groups(mins)
    with np.errstate(all="ignore"):
        ls = np.where((max_scale > 0)[:, None], nearest_int((F32(15) / max_scale)[:, None] * scales), 0)
        lm = np.where((max_min > 0)[:, None], nearest_int((F32(15) / max_min)[:, None] * mins), 0)
    sc = (ls | (lm << 4)) & 0xFF  # the C stores ints into uint8 fields
    d = np.where(max_scale > 0, max_scale / F32(15), F32(0))
    dmin = np.where(max_min > 0, max_min / F32(15), F32(0))
    dg = f16_round(d)[:, None] * (sc & 0xF).astype(F32)
    dmg = f16_round(dmin)[:, None] * (sc >> 4).astype(F32)
    L = _requant(x.reshape(n, 16, 16), L, dg, dmg, 0, 3)
    return np.concatenate([sc.astype(np.uint8), pack_crumbs(L.reshape(n, 256)), f16_bytes(d), f16_bytes(dmin)],
                          axis=1)


def _symmetric_groups(x: np.ndarray, search, nmax: int):
    """A symmetric search on every 16-value group of a super-block: (L (n, 16, 16), scales (n, 16), the scale of
    largest magnitude per super-block)."""
    n = x.shape[0]
    L, sc = search(x.reshape(n * 16, 16), nmax)
    scales = sc.reshape(n, 16)
    return L.reshape(n, 16, 16), scales, abs_max_signed(scales)


def _bit_planes(high: np.ndarray) -> np.ndarray:
    """(n, 8, 32) booleans -> (n, 32) bytes whose bit b is high[:, b]."""
    return np.bitwise_or.reduce(high.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    L, scales, max_scale = _symmetric_groups(x, make_q3_quants, 4)
    has = max_scale != 0
    with np.errstate(all="ignore"):
        iscale = F32(-32) / max_scale
        l8 = ((nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128  # stored into an int8_t first
    ls = np.where(has[:, None], np.clip(l8, -32, 31) + 32, 0)  # 6-bit scales, 0 where the block is all zero
    packed = np.zeros((n, 12), dtype=np.int64)
    packed[:, :8] = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    hi = ls >> 4
    for j in range(16):
        packed[:, 8 + j % 4] |= np.where(has, hi[:, j] << (2 * (j // 4)), 0)
    d = np.where(has, F32(1) / iscale, F32(0))
    dg = f16_round(d)[:, None] * (ls - 32).astype(F32)
    L = _requant(x.reshape(n, 16, 16), L, np.where(has[:, None], dg, F32(0)), None, -4, 3, 4).reshape(n, 256)
    # hmask bit j // 32 of byte j % 32 holds whether L[j] > 3.
    hmask = _bit_planes((L > 3).reshape(n, 8, 32))
    return np.concatenate([hmask, pack_crumbs(np.where(L > 3, L - 4, L)), packed.astype(np.uint8), f16_bytes(d)],
                          axis=1)


def _rms_weights(xg: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's group weights: sqrt(mean x^2) + |x|."""
    av = np.sqrt(seqsum(xg * xg) / F32(32))
    return av[:, None] + np.abs(xg)


def _k4_scales(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The Q4_K/Q5_K head: (L, d, dmin, the 12-byte 6-bit scale/min field, requantized L (n, 256))."""
    n = x.shape[0]
    L, scales, mins = _affine_groups(x, 32, nmax, rmin, nstep, False, _rms_weights)
    max_scale, max_min = _max_over_groups(scales), _max_over_groups(mins)
    with np.errstate(all="ignore"):
        inv_s = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_m = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(nearest_int(inv_s[:, None] * scales) & 0xFF, 63)  # uint8_t, then MIN(63, .)
    lm = np.minimum(nearest_int(inv_m[:, None] * mins) & 0xFF, 63)
    field = np.zeros((n, 12), dtype=np.int64)
    field[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    field[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    field[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    d, dmin = max_scale / F32(63), max_min / F32(63)
    dg = f16_round(d)[:, None] * ls.astype(F32)
    dmg = f16_round(dmin)[:, None] * lm.astype(F32)
    L = _requant(x.reshape(n, 8, 32), L, dg, dmg, 0, nmax).reshape(n, 256)
    return d, dmin, field.astype(np.uint8), L


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, field, L = _k4_scales(x, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32)
    qs = pack_nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), field, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, field, L = _k4_scales(x, 31, -0.5, 15)
    q = L.reshape(-1, 4, 2, 32)
    qs = pack_nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    # qh byte j: bit 2c from L[64c + j] > 15, bit 2c+1 from L[64c + 32 + j] > 15.
    qh = _bit_planes((q > 15).reshape(-1, 8, 32))
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), field, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    L, scales, max_scale = _symmetric_groups(x, make_qx_quants, 32)
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = F32(-128) / max_scale
        d = np.where(zero, F32(0), F32(1) / iscale)
        ls = np.where(zero[:, None], 0, np.minimum(127, nearest_int(iscale[:, None] * scales)))
    sc8 = ((ls + 128) & 0xFF) - 128  # the int8_t scales field
    dg = f16_round(d)[:, None] * sc8.astype(F32)
    L = _requant(x.reshape(n, 16, 16), L, dg, None, -32, 31, 32).reshape(n, 2, 4, 32)
    ql = np.concatenate([pack_nibbles(L[:, :, 0], L[:, :, 2]), pack_nibbles(L[:, :, 1], L[:, :, 3])], axis=2)
    h = (L >> 4).astype(np.uint8)
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc8.astype(np.uint8), f16_bytes(d)], axis=1)
    out[zero] = 0  # ggml memsets an all-zero super-block
    return out
