"""The dequantizing GEMV's k-quants (256-element super-blocks): Q4_K and Q5_K (32-element sub-blocks, tiles of 4
chunks of 64 elements), Q2_K, Q3_K and Q6_K (16-element sub-blocks, tiles of 2 halves of 128 elements). Each has
x_prep, w_load and w_dot as in kernels_src/gguf_gemv_legacy.py."""

from __future__ import annotations

from kernels_src.dsl import tl
from kernels_src.gguf_gemv_common import _add, _dot, _f16, _rsum, _u16, _words, _x_vals

# --- Q4_K: super-blocks of d, dmin, 12 bytes of 6-bit scales and mins, 32 words of quants -------------------------
# Word j of chunk c (c < 4, j < 8) holds elements 64c + 4j + k in its low nibbles (sub-block 2c) and 64c + 32 + 4j + k
# in its high nibbles (sub-block 2c + 1), k < 4. Tiles are [STEP, 4 chunks, lanes per chunk, 4 words].
# Fields (word, shift) of elements k = 0..3, with up = word >> 12 bringing bytes 2 and 3 down:
_Q4K_LO = ((0, 0), (0, 8), (0, 16), (1, 12))
_Q4K_HI = ((0, 4), (0, 12), (1, 8), (1, 16))


def _chunks():
    return tl.arange(0, 4)[None, :, None, None]


def _q4k_x(xm, sb, dec, PARTS: int, hi_fields=_Q4K_HI):
    lo, hi = [], []
    for j in _words(8, PARTS, 4):
        quad = 64 * sb + 16 * _chunks() + j
        lo.append(_x_vals(xm, quad, 4))
        hi.append(_x_vals(xm, quad + 8, 4))
    return ([[dec.x(v, s) for v, (_, s) in zip(x, _Q4K_LO, strict=True)] for x in lo],
            [[dec.x(v, s) for v, (_, s) in zip(x, hi_fields, strict=True)] for x in hi], _add([_rsum(x) for x in lo]),
            _add([_rsum(x) for x in hi]))


def _q4k_load(blk, mask, PARTS: int):
    qs = blk.to(tl.pointer_type(tl.uint32)) + 4 + 8 * _chunks()
    head = blk.to(tl.pointer_type(tl.uint64))
    return [tl.load(qs + j) for j in _words(8, PARTS, 4)] + [tl.load(head + k, mask=mask, other=0) for k in range(2)]


def _q4k_scales(h0, h1):
    """(d, dmin, 6-bit scales, 6-bit mins): 16-bit pairs whose bytes 0 and 1 belong to sub-blocks 2c and 2c + 1."""
    c = _chunks()
    dd, s0, s1, s2 = h0.to(tl.uint32), (h0 >> 32).to(tl.uint32), h1.to(tl.uint32), (h1 >> 32).to(tl.uint32)
    low, sh = c < 2, (c & 1) * 16  # sub-blocks 0-3 keep 6 bits in place; 4-7 take 4 + 2 from two bytes
    m = tl.where(low, 0x3F3F, 0x0F0F).to(tl.uint32)
    top = tl.where(low, 0, 0x3030).to(tl.uint32)  # bits 6, 7 of s0 (s1) moved to 4, 5 for sub-blocks 4-7
    sc = ((tl.where(low, s0, s2) >> sh) & m) | ((s0 >> (sh + 2)) & top)
    mn = (tl.where(low, s1 >> sh, s2 >> (sh + 4)) & m) | ((s1 >> (sh + 2)) & top)
    return _f16(dd), _f16(dd >> 16), sc, mn


def _k4_sum(head, s_lo, s_hi, xp, dec):
    """Q4_K's and Q5_K's partial sum from the quant sums of sub-blocks 2c, 2c + 1: scales once, mins through x."""
    sum_lo, sum_hi = xp[2], xp[3]
    d, dmin, sc, mn = _q4k_scales(*head)
    lo, hi = lambda t: (t & 0xFF).to(tl.float32), lambda t: (t >> 8).to(tl.float32)
    return ((d * dec.unit) * (lo(sc) * _add(s_lo) + hi(sc) * _add(s_hi))
            - dmin * (lo(mn) * sum_lo + hi(mn) * sum_hi))


def _q4k_dot(raw, xp, dec):
    s_lo, s_hi = [], []
    for w, xl, xh in zip(raw[:-2], xp[0], xp[1], strict=True):
        words = (w, w >> 12)
        s_lo.append(_dot([dec.q(words[i], s, 4) for i, s in _Q4K_LO], xl))
        s_hi.append(_dot([dec.q(words[i], s, 4) for i, s in _Q4K_HI], xh))
    return _k4_sum(raw[-2:], s_lo, s_hi, xp, dec)


# --- Q5_K: Q4_K's header, then qh[32], then Q4_K's 128 bytes of nibbles -----------------------------------------------
# Element 64c + 32h + l takes bit 2c + h of qh[l] on top of its nibble, so qh word j (bytes l = 4j..4j + 3) serves
# word j of every chunk. Shifted down 2c, bit 0 (1) of each byte is the fifth bit of sub-block 2c (2c + 1); shifted
# left 4 (3) it lands just above the low nibbles (the high nibbles, once shifted down 4), so both sub-blocks' 5-bit
# fields are read at _Q4K_LO's places: four shifts and two LOP3 a word of 8 quants. 176-byte super-blocks keep
# 16-byte alignment, so quants and qh are 32-bit words loaded 4 at a time.

def _q5k_x(xm, sb, dec, PARTS: int):
    return _q4k_x(xm, sb, dec, PARTS, _Q4K_LO)


def _q5k_load(blk, mask, PARTS: int):
    w32 = blk.to(tl.pointer_type(tl.uint32))
    qs, qh, head = w32 + 12 + 8 * _chunks(), w32 + 4 + 0 * _chunks(), blk.to(tl.pointer_type(tl.uint64))
    words = _words(8, PARTS, 4)
    return ([tl.load(qs + j) for j in words] + [tl.load(qh + j) for j in words]
            + [tl.load(head + k, mask=mask, other=0) for k in range(2)])


def _q5k_dot(raw, xp, dec):
    n = (len(raw) - 2) // 2
    c2 = 2 * _chunks()
    s_lo, s_hi = [], []
    for w, qh, xl, xh in zip(raw[:n], raw[n:2 * n], xp[0], xp[1], strict=True):
        t = qh >> c2
        lo = (w & 0x0F0F0F0F) | ((t << 4) & 0xF0F0F0F0)  # (bits 5-7 of each byte: strays outside the fields)
        hi = ((w >> 4) & 0x0F0F0F0F) | ((t << 3) & 0xF0F0F0F0)
        for word, xs, acc in ((lo, xl, s_lo), (hi, xh, s_hi)):
            words = (word, word >> 12)
            acc.append(_dot([dec.q(words[i], s, 5) for i, s in _Q4K_LO], xs))
    return _k4_sum(raw[-2:], s_lo, s_hi, xp, dec)


# --- 16-element sub-blocks: Q2_K, Q3_K, Q6_K ----------------------------------------------------------------------
# In half h, element 128h + 32k + l (l < 32) is field k of byte l of the half's quant arrays, with scale 8h + 2k +
# l // 16. Word i of a half's 16 (16-bit: Q3_K's and Q6_K's super-blocks are only 2-byte aligned, Q2_K's 4) holds
# l = 2i, 2i + 1. Tiles are [STEP, 2 halves, lanes per half, 4 words]; a lane's words share l // 16 = i // 8, so
# the lane takes byte i // 8 of each 16-bit scale word.

def _halves():
    return tl.arange(0, 2)[None, :, None, None]


def _half_x(xm, sb, dec, PARTS: int, shifts, offset: float | None = None):
    """x pairs (2i, 2i + 1) of field k (shifts(k): their fields' places) and their sums, for each part and k.
    With an offset (Q3_K's -4), the sums come as offset * sum / unit, added to each dot of fields (in units of
    2**-xs), and d * unit multiplies once a lane: 15 fewer registers for Q3_K in the AOT build."""
    out = []
    for i in _words(16, PARTS, 4):
        for k in range(4):
            v = _x_vals(xm, 128 * sb + 64 * _halves() + 16 * k + i, 2)
            s0, s1 = shifts(k)
            xsum = _rsum(v) if offset is None else _rsum(v) * (offset / dec.unit)
            out.append(([dec.x(v[0], s0), dec.x(v[1], s1)], xsum))
    return out


def _scale_byte(i):
    """The shift that brings the lane's byte of a 16-bit scale word down: 8 (l // 16)."""
    return tl.min(i, axis=-1, keep_dims=True) // 8 * 8


# Q6_K (ql[128], qh[64], int8 scales[16], d): element 128h + 32k + l is nibble k // 2 of ql[64h + 32(k % 2) + l] plus
# bits 2k, 2k + 1 of qh[32h + l] on top, minus 32.

def _q6k_x(xm, sb, dec, PARTS: int):
    return _half_x(xm, sb, dec, PARTS, lambda k: (0, 8))


def _q6k_load(blk, mask, PARTS: int):
    h, w16 = _halves(), blk.to(tl.pointer_type(tl.uint16))
    raw = []
    for i in _words(16, PARTS, 4):
        raw += [_u16(w16 + o + i) for o in (32 * h, 32 * h + 16, 64 + 16 * h)]  # ql, ql + 32, qh
        raw += [_u16(w16 + 96 + 4 * h + k, mask) for k in range(4)]  # scales 8h + 2k + (0, 1)
    return raw + [_u16(w16 + 104, mask)]


def _q6k_dot(raw, xp, dec, PARTS: int):
    sel = lambda lo, hi: (lo & 0x0F0F) | (hi & 0xF0F0)  # 4 low bits from lo, bits 4-5 (of each byte) from hi
    acc = 0.0
    for p, i in enumerate(_words(16, PARTS, 4)):
        a, b, qh, *scw = raw[7 * p:7 * p + 7]
        six = (sel(a, qh << 4), sel(b, qh << 2), sel(a >> 4, qh), sel(b >> 4, qh >> 2))
        shift = _scale_byte(i)
        for k in range(4):
            xs, xsum = xp[4 * p + k]
            sc = (scw[k] >> shift).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
            acc = acc + sc * (dec.unit * _dot([dec.q(six[k], 0, 6), dec.q(six[k], 8, 6)], xs) - 32.0 * xsum)
    return _f16(raw[-1]) * acc


# Q2_K (scales[16]: 4-bit scale | 4-bit min << 4, qs[64], d, dmin): field k is bits 2k, 2k + 1 of qs[32h + l], read in
# place at bits 2k and 8 + 2k of its word. Only d and dmin are masked: a block past the end then adds 0.

def _crumb_x(xm, sb, dec, PARTS: int):
    return _half_x(xm, sb, dec, PARTS, lambda k: (2 * k, 8 + 2 * k))


def _q2k_load(blk, mask, PARTS: int):
    h, w16 = _halves(), blk.to(tl.pointer_type(tl.uint16))
    qs = [_u16(w16 + 8 + 16 * h + i) for i in _words(16, PARTS, 4)]
    return qs + [_u16(w16 + 4 * h + k) for k in range(4)] + [_u16(w16 + 40, mask), _u16(w16 + 41, mask)]


def _q2k_dot(raw, xp, dec, PARTS: int):
    scw = raw[PARTS:PARTS + 4]  # scale bytes 8h + 2k + (0, 1)
    acc_q, acc_m = 0.0, 0.0
    for p, i in enumerate(_words(16, PARTS, 4)):
        w, shift = raw[p], _scale_byte(i)
        for k in range(4):
            xs, xsum = xp[4 * p + k]
            s = scw[k] >> shift
            acc_q = acc_q + (s & 0xF).to(tl.float32) * _dot([dec.q(w, 2 * k, 2), dec.q(w, 8 + 2 * k, 2)], xs)
            acc_m = acc_m + ((s >> 4) & 0xF).to(tl.float32) * xsum
    return (_f16(raw[-2]) * dec.unit) * acc_q - _f16(raw[-1]) * acc_m


# Q3_K (hmask[32], qs[64], 12 bytes of 6-bit scales, d): field k is bits 2k, 2k + 1 of qs[32h + l] plus bit 4h + k of
# hmask[l] on top, minus 4. hmask shifted down 4h and left k + 2 puts that bit just above the crumb: one shift and
# one LOP3 a word and field. Scale 8h + 2k + g (g = l // 16) is nibble h of byte 2k + g, with bits 4h + 2 (k // 2)
# of byte 8 + 2 (k % 2) + g on top, minus 32.

def _q3k_load(blk, mask, PARTS: int):
    h, w16 = _halves(), blk.to(tl.pointer_type(tl.uint16))
    raw = []
    for i in _words(16, PARTS, 4):
        raw += [_u16(w16 + 16 + 16 * h + i), _u16(w16 + 0 * h + i)]  # qs, hmask
    return raw + [_u16(w16 + 48 + 0 * h + k) for k in range(6)] + [_u16(w16 + 54, mask)]


def _q3k_dot(raw, xp, dec, PARTS: int):
    h4, scw = 4 * _halves(), raw[2 * PARTS:2 * PARTS + 6]
    acc = 0.0
    for p, i in enumerate(_words(16, PARTS, 4)):
        qs, hm = raw[2 * p], raw[2 * p + 1] >> h4
        shift = _scale_byte(i) + h4
        for k in range(4):
            xs, xoff = xp[4 * p + k]
            three = (qs & (0x0303 << 2 * k)) | ((hm << (k + 2)) & (0x0404 << 2 * k))
            sc = ((scw[k] >> shift) & 0xF) | (((scw[4 + k % 2] >> (shift + 2 * (k // 2))) & 3) << 4)
            dot = _dot([dec.q(three, 2 * k, 3), dec.q(three, 8 + 2 * k, 3)], xs)
            acc = acc + (sc.to(tl.float32) - 32.0) * (dot + xoff)
    return (_f16(raw[-1]) * dec.unit) * acc


K_QTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def family(QTYPE: str, PARTS: int):
    """(tile rank, accumulator shape after STEP, x_prep, w_load, w_dot) of a k-quant."""
    if QTYPE == "Q4_K":
        return 4, (4, 2 // PARTS, 1), _q4k_x, _q4k_load, _q4k_dot
    if QTYPE == "Q5_K":
        return 4, (4, 2 // PARTS, 1), _q5k_x, _q5k_load, _q5k_dot
    halves = {"Q6_K": (_q6k_x, _q6k_load, _q6k_dot), "Q2_K": (_crumb_x, _q2k_load, _q2k_dot),
              "Q3_K": (_crumb_x, _q3k_load, _q3k_dot)}
    x_prep, w_load, w_dot = halves[QTYPE]
    if QTYPE == "Q3_K":
        x_prep = lambda xm, sb, dec, PARTS: _half_x(xm, sb, dec, PARTS, lambda k: (2 * k, 8 + 2 * k), -4.0)
    return 4, (2, 4 // PARTS, 1), x_prep, w_load, lambda raw, xp, dec: w_dot(raw, xp, dec, PARTS)
