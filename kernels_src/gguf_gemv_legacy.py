"""The dequantizing GEMV's 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): for each, x_prep (x for one step,
once), w_load (one row's raw tiles for the step) and w_dot (those tiles and the prepared x to a partial sum), so that
kernels_src/dequant_gemv.py can issue every load of a step first. Tiles are [STEP, lanes on a block, 4 words]."""

from __future__ import annotations

from kernels_src.dsl import tl
from kernels_src.gguf_gemv_common import _add, _dot, _f16, _rsum, _u16, _words, _x_vals

# --- Q4_0, Q4_1: 8 words of quants; word i holds elements 2i, 2i + 1 (low nibbles) and 16 + 2i, 17 + 2i ------------
# Q5_0 and Q5_1 decode the same words with the fifth bits put above each nibble, so their 5-bit fields of elements
# 2i, 2i + 1, 16 + 2i, 17 + 2i sit at bits 0, 8 of one word and 0, 8 of another (_Q5_FIELDS) instead.
_Q4_FIELDS = (0, 8, 4, 12)
_Q5_FIELDS = (0, 8, 0, 8)


def _q4_x(xm, b, dec, PARTS: int, fields=_Q4_FIELDS):
    xs, sums = [], []
    for i in _words(8, PARTS):
        lo, hi = _x_vals(xm, 16 * b + i, 2), _x_vals(xm, 16 * b + 8 + i, 2)
        xs.append([dec.x(v, s) for v, s in zip(lo + hi, fields, strict=True)])
        sums.append(_rsum(lo + hi))
    return xs, _add(sums)


def _q4_load(blk, mask, QTYPE: str, PARTS: int):
    w16 = blk.to(tl.pointer_type(tl.uint16))
    head = 2 if QTYPE == "Q4_1" else 1  # d (and m) come first
    return [_u16(w16 + head + i) for i in _words(8, PARTS)] + [_u16(w16 + k, mask) for k in range(head)]


def _q4_dot(raw, xp, dec, QTYPE: str):
    xs, xsum = xp
    fields = lambda w: [dec.q(w, 0, 4), dec.q(w, 8, 4), dec.q(w, 4, 4), dec.q(w, 12, 4)]
    s = _add([_dot(fields(w), x) for w, x in zip(raw[:len(xs)], xs, strict=True)])
    d = _f16(raw[len(xs)])
    if QTYPE == "Q4_0":
        return (d * dec.unit) * s - (8.0 * d) * xsum
    return (d * dec.unit) * s + _f16(raw[-1]) * xsum


# --- Q5_0 (d, qh, 16 bytes), Q5_1 (d, m, qh, 16 bytes): Q4's nibbles, bit e of the 32-bit qh on top of element e --
# Word i's fifth bits are qh bits 2i, 2i + 1 (low nibbles) and 16 + 2i, 17 + 2i (high nibbles): (qh >> 2i) & 0x30003
# times 0x810 copies them, without carries, to bits 4 and 12 (and 20, 28, for the high nibbles once shifted down 16),
# just above each nibble after masking: one shift, AND, IMAD and LOP3 a word for the low nibbles and three more for
# the high ones, where shifting each bit into place alone takes two ops a bit.

def _q5_x(xm, b, dec, PARTS: int):
    return _q4_x(xm, b, dec, PARTS, _Q5_FIELDS)


def _q5_load(blk, mask, QTYPE: str, PARTS: int):
    w16 = blk.to(tl.pointer_type(tl.uint16))
    head = 2 if QTYPE == "Q5_1" else 1
    words = [_u16(w16 + head + 2 + i) for i in _words(8, PARTS)]
    return words + [_u16(w16 + head), _u16(w16 + head + 1)] + [_u16(w16 + k, mask) for k in range(head)]


def _q5_dot(raw, xp, dec, QTYPE: str, PARTS: int):
    xs, xsum = xp
    n = len(xs)
    qh = raw[n] | (raw[n + 1] << 16)
    s = []
    for w, x, i in zip(raw[:n], xs, _words(8, PARTS), strict=True):
        top = ((qh >> (2 * i)) & 0x30003) * 0x810  # bits 4, 12: the low nibbles' fifth bits; 20, 28: the high ones'
        lo = (w & 0x0F0F) | (top & 0xF0F0)  # (bits 5, 13 hold strays outside the 5-bit fields)
        hi = ((w >> 4) & 0x0F0F) | ((top >> 16) & 0xF0F0)
        s.append(_dot([dec.q(lo, 0, 5), dec.q(lo, 8, 5), dec.q(hi, 0, 5), dec.q(hi, 8, 5)], x))
    d = _f16(raw[n + 2])
    if QTYPE == "Q5_0":
        return (d * dec.unit) * _add(s) - (16.0 * d) * xsum
    return (d * dec.unit) * _add(s) + _f16(raw[-1]) * xsum


# --- Q8_0: 16 words of quants; word i holds elements 2i, 2i + 1 -----------------------------------------------------

def _q8_x(xm, b, dec, PARTS: int):
    vals = [_x_vals(xm, 16 * b + i, 2) for i in _words(16, PARTS)]
    return [[dec.x(v[0], 0), dec.x(v[1], 8)] for v in vals], _add([_rsum(v) for v in vals])


def _q8_load(blk, mask, PARTS: int):
    w16 = blk.to(tl.pointer_type(tl.uint16))
    return [_u16(w16 + 1 + i) for i in _words(16, PARTS)] + [_u16(w16, mask)]


def _q8_dot(raw, xp, dec):
    xs, xsum = xp
    signed = [w ^ 0x80808080 for w in raw[:-1]]  # int8 q -> unsigned q + 128 (32-bit: no 16-bit packing)
    s = _add([_dot([dec.q(w, 0, 8), dec.q(w, 8, 8)], x) for w, x in zip(signed, xs, strict=True)])
    d = _f16(raw[-1])
    return (d * dec.unit) * s - (128.0 * d) * xsum


LEGACY_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def family(QTYPE: str, PARTS: int):
    """(tile rank, accumulator shape after STEP, x_prep, w_load, w_dot) of a 32-element format."""
    if QTYPE == "Q8_0":
        return 3, (4 // PARTS, 1), _q8_x, _q8_load, _q8_dot
    if QTYPE in ("Q5_0", "Q5_1"):
        return (3, (2 // PARTS, 1), _q5_x, lambda blk, mask, PARTS: _q5_load(blk, mask, QTYPE, PARTS),
                lambda raw, xp, dec: _q5_dot(raw, xp, dec, QTYPE, PARTS))
    return (3, (2 // PARTS, 1), _q4_x, lambda blk, mask, PARTS: _q4_load(blk, mask, QTYPE, PARTS),
            lambda raw, xp, dec: _q4_dot(raw, xp, dec, QTYPE))
