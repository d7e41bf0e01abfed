"""fp32 -> GGUF block formats (the inverse of gguf_quants.dequantize), vectorized numpy.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 follow ggml's quantize_row_*_ref (byte for byte what gguf-py's
`gguf.quants.quantize` writes); the k-quants are ports of ggml's reference quantizers (kquant_quantize.py). Our own
code, so the tests can hold it against both gguf-py and ggml's C compiled from source."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ir.formats import kquant_quantize as kq
from ir.formats.gguf_quants import row_bytes, spec
from ir.formats.quant_common import CHUNK_ELEMS, F32, abs_max_signed, by_rows, f16_bytes, pack_nibbles

__all__ = ["QUANTIZABLE", "quantize"]


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, F32(0), F32(1) / d).astype(F32)


def _trunc_u8(v: np.ndarray, top: int) -> np.ndarray:
    """MIN(top, (int8_t) v) for the non-negative v the legacy formats produce."""
    return np.minimum(np.trunc(v).astype(np.int64), top)


def _high_bits(q: np.ndarray) -> np.ndarray:
    """Q5's qh: bit j of a little-endian uint32 is bit 4 of quant j."""
    return np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")


def _halves(q: np.ndarray) -> np.ndarray:
    """32 quants as 16 bytes: quant j in the low nibble of byte j, quant j + 16 in its high nibble."""
    return pack_nibbles(q[:, :16], q[:, 16:])


def _q4_0(x: np.ndarray) -> np.ndarray:
    d = abs_max_signed(x) / F32(-8)
    q = _trunc_u8(x * _inverse(d)[:, None] + F32(8.5), 15)
    return np.concatenate([f16_bytes(d), _halves(q)], axis=1)


def _q5_0(x: np.ndarray) -> np.ndarray:
    d = abs_max_signed(x) / F32(-16)
    q = _trunc_u8(x * _inverse(d)[:, None] + F32(16.5), 31)
    return np.concatenate([f16_bytes(d), _high_bits(q), _halves(q)], axis=1)


def _affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mn, mx = x.min(axis=1), x.max(axis=1)
    d = (mx - mn) / F32(levels)
    return d, mn, _trunc_u8((x - mn[:, None]) * _inverse(d)[:, None] + F32(0.5), levels)


def _q4_1(x: np.ndarray) -> np.ndarray:
    d, mn, q = _affine(x, 15)
    return np.concatenate([f16_bytes(d), f16_bytes(mn), _halves(q)], axis=1)


def _q5_1(x: np.ndarray) -> np.ndarray:
    d, mn, q = _affine(x, 31)
    return np.concatenate([f16_bytes(d), f16_bytes(mn), _high_bits(q), _halves(q)], axis=1)


def _q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1) / F32(127)
    v = x * _inverse(d)[:, None]
    a = np.abs(v)  # roundf: half away from zero, without the error of floor(a + 0.5) just below a half
    r = np.floor(a) + np.floor(F32(2) * (a - np.floor(a)))
    q = (np.sign(v) * r).astype(np.int8)
    return np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)


_QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": kq.quantize_q2_k, "Q3_K": kq.quantize_q3_k, "Q4_K": kq.quantize_q4_k, "Q5_K": kq.quantize_q5_k,
    "Q6_K": kq.quantize_q6_k,
}
QUANTIZABLE = tuple(_QUANTIZERS)


def quantize(values: np.ndarray, kind: str) -> np.ndarray:
    """values (..., n) with n a whole number of `kind`'s blocks -> uint8 [rows, row bytes] of GGUF blocks."""
    s = spec(kind)
    fn = _QUANTIZERS.get(s.name)
    if fn is None:
        raise ValueError(f"no quantizer for {s.name}; quantizable: {', '.join(QUANTIZABLE)}")
    x = np.asarray(values, dtype=F32)
    rb = row_bytes(s.name, x.shape[-1])  # checks that rows are a whole number of blocks
    blocks = np.ascontiguousarray(x).reshape(-1, s.block_size)
    return by_rows(blocks, max(1, CHUNK_ELEMS // s.block_size), fn).reshape(-1, rb)
