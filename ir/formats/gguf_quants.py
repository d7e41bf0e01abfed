"""Vectorized numpy dequantization of GGUF / ggml tensor types.

This is our own implementation of the block formats defined in llama.cpp's
``ggml-common.h`` / ``ggml-quants.c`` (``dequantize_row_*``).  It does not use
``gguf.quants``; the test-suite compares the two.

Conventions
-----------
* Shapes are numpy / row-major: the *last* dimension is the contiguous one, so
  a linear weight comes out as HF ``[out, in]``.  GGUF stores ``ne[]`` in the
  opposite order (``ne[0]`` is the contiguous dimension), so callers must pass
  ``tuple(reversed(ne))``.
* Quantization blocks never straddle rows (ggml requires ``ne[0]`` to be a
  multiple of the block size), so the raw bytes of a tensor are simply
  ``n_rows * row_bytes(qtype, n_cols)`` bytes of consecutive blocks.
* All multi-byte fields are little-endian (we read them with explicit ``<``
  dtypes so the code is also correct on a big-endian host).
* The arithmetic follows the reference C code's order of operations (e.g.
  ``(d * sc) * q - dmin * m``) in float32 so that the results are bit-identical
  to ggml's scalar reference, not merely close.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

__all__ = ["QTYPES", "QuantSpec", "dequantize", "row_bytes", "spec"]

# Elements per "super-block" of the k-quants.
QK_K = 256


@dataclass(frozen=True)
class QuantSpec:
    """Static description of one ggml tensor type."""

    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    ggml_type: int  # ggml_type enum value as stored in the GGUF tensor info


def _mk(name: str, block_size: int, type_size: int) -> QuantSpec:
    # The id comes from gguf's enum so it can never drift from the file format.
    return QuantSpec(name, block_size, type_size, int(GGMLQuantizationType[name]))


# Block sizes / byte sizes from ggml-common.h (the block_* struct definitions).
QTYPES: dict[str, QuantSpec] = {
    s.name: s
    for s in (
        _mk("F32", 1, 4),
        _mk("F16", 1, 2),
        _mk("BF16", 1, 2),
        _mk("Q4_0", 32, 2 + 16),  # d, 32 x 4-bit
        _mk("Q4_1", 32, 2 + 2 + 16),  # d, m, 32 x 4-bit
        _mk("Q5_0", 32, 2 + 4 + 16),  # d, qh (32 high bits), 32 x low nibble
        _mk("Q5_1", 32, 2 + 2 + 4 + 16),  # d, m, qh, 32 x low nibble
        _mk("Q8_0", 32, 2 + 32),  # d, 32 x int8
        _mk("Q2_K", QK_K, 16 + 64 + 2 + 2),  # scales, qs, d, dmin
        _mk("Q3_K", QK_K, 32 + 64 + 12 + 2),  # hmask, qs, scales, d
        _mk("Q4_K", QK_K, 2 + 2 + 12 + 128),  # d, dmin, scales, qs
        _mk("Q5_K", QK_K, 2 + 2 + 12 + 32 + 128),  # d, dmin, scales, qh, qs
        _mk("Q6_K", QK_K, 128 + 64 + 16 + 2),  # ql, qh, scales, d
    )
}

_BY_ID: dict[int, QuantSpec] = {s.ggml_type: s for s in QTYPES.values()}


def _unsupported(qtype: object) -> ValueError:
    return ValueError(f"unsupported GGUF tensor type {qtype!r}; supported types: " + ", ".join(QTYPES))


def spec(qtype: str | int | GGMLQuantizationType) -> QuantSpec:
    """Look up a type by name (any case) or by ggml type id / enum member."""
    if isinstance(qtype, str):
        s = QTYPES.get(qtype.strip().upper())
    elif isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        # GGMLQuantizationType is an IntEnum, so it lands here too.
        s = _BY_ID.get(int(qtype))
    else:
        s = None
    if s is None:
        raise _unsupported(qtype)
    return s


def row_bytes(qtype: str | int | GGMLQuantizationType, n_cols: int) -> int:
    """Bytes occupied by one row of ``n_cols`` elements of type ``qtype``."""
    return _row_bytes(spec(qtype), n_cols)


def _row_bytes(s: QuantSpec, n_cols: int) -> int:
    n_cols = int(n_cols)
    if n_cols < 0:
        raise ValueError(f"n_cols must be non-negative, got {n_cols}")
    if n_cols % s.block_size:
        raise ValueError(
            f"row length {n_cols} is not a multiple of the {s.name} block size "
            f"{s.block_size} (ggml blocks never span rows)"
        )
    return n_cols // s.block_size * s.type_size


# --------------------------------------------------------------------------
# Field helpers.  Every kernel receives ``b``: a C-contiguous uint8 array of
# shape (n_blocks, type_size) and returns float32 (n_blocks, block_size).
# --------------------------------------------------------------------------

_F16 = np.dtype("<f2")
_NIBBLE_SHIFT = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFT = np.array([0, 2, 4, 6], dtype=np.uint8)


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """fp16 field at byte ``off`` of each block, as float32 of shape (n, 1)."""
    # The 2-byte column slice is strided by type_size; copy it so the view to
    # float16 is legal regardless of numpy version.
    return np.ascontiguousarray(b[:, off : off + 2]).view(_F16).astype(np.float32)


def _nibbles_lo_then_hi(qs: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k) values: all low nibbles, then all high nibbles.

    This is the layout of the 32-element legacy quants (element j is the low
    nibble of qs[j], element j+16 its high nibble).
    """
    n, k = qs.shape
    q = qs.reshape(n, 1, k) >> _NIBBLE_SHIFT.reshape(1, 2, 1)
    return (q & 0x0F).reshape(n, 2 * k)


def _bits_per_column(bytes_: np.ndarray) -> np.ndarray:
    """(n, 32) bytes -> (n, 8 * 32) bits where bit s of byte l lands at s*32+l.

    The k-quants store one extra bit per element in a 32-byte mask: the element
    at index 32*s + l of the super-block uses bit s of byte l (Q3_K hmask, Q5_K
    qh).
    """
    n = bytes_.shape[0]
    bits = np.unpackbits(bytes_.reshape(n, 32, 1), axis=2, bitorder="little")
    return bits.transpose(0, 2, 1).reshape(n, 8 * 32)


def _k4_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 six-bit scales and mins.

    From ``get_scale_min_k4``: bytes 0-3 hold scales 0-3 in their low 6 bits,
    bytes 4-7 hold mins 0-3 likewise; scales/mins 4-7 take their low 4 bits from
    the nibbles of bytes 8-11 and their top 2 bits from the otherwise unused
    top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, m, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([m & 0x3F, (c >> 4) | ((m >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    # x = (q - 8) * d, q unsigned 4-bit: symmetric around zero.
    d = _f16(b, 0)
    q = _nibbles_lo_then_hi(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    # x = q * d + m: affine (scale + minimum), q unsigned 4-bit.
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles_lo_then_hi(b[:, 4:20]).astype(np.float32)
    return d * q + m


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # qh is a little-endian uint32 whose bit j is the 5th bit of element j;
    # unpacking its 4 bytes LSB-first yields exactly bit j at position j.
    high = np.unpackbits(qh, axis=1, bitorder="little")
    return _nibbles_lo_then_hi(qs) | (high << 4)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    q = _q5_values(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _q5_values(b[:, 4:8], b[:, 8:24]).astype(np.float32)
    return d * q + m


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    return d * b[:, 2:34].view(np.int8).astype(np.float32)


def _crumbs_k(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K 2-bit values: (n, 64) bytes -> (n, 256).

    Each 128-element half of the super-block uses 32 bytes; element
    128*h + 32*j + l is bits [2j, 2j+2) of byte 32*h + l.
    """
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32) >> _CRUMB_SHIFT.reshape(1, 1, 4, 1)
    return (q & 0x03).reshape(n, QK_K)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc = b[:, 0:16]  # per 16 elements: low nibble scale, high nibble min
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = _crumbs_k(b[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask, qs, sc = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales (offset by 32): the low nibbles of bytes 0-7 give
    # scales 0-7, their high nibbles scales 8-15; scale i's top 2 bits are bits
    # [2*(i//4), +2) of byte 8 + i%4.
    low = np.concatenate([sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4], axis=1)
    high = (sc[:, 8:12].reshape(n, 1, 4) >> _CRUMB_SHIFT.reshape(1, 4, 1)) & 0x03
    scales = (low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    dl = (d * scales.astype(np.float32)).reshape(n, 16, 1)
    # Value = 2 low bits minus 4 when the hmask bit is *clear* (a set bit means
    # "no offset"), giving the range [-4, 3].
    q = _crumbs_k(qs).astype(np.int8) + (_bits_per_column(hmask).astype(np.int8) << 2)
    q = (q - np.int8(4)).reshape(n, 16, 16).astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K 4-bit values: (n, 128) bytes -> (n, 8, 32) per sub-block.

    Each 64-element chunk c uses bytes 32c..32c+31: low nibbles are
    sub-block 2c, high nibbles sub-block 2c+1.
    """
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> _NIBBLE_SHIFT.reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, 8, 32)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales_mins(b[:, 4:16])
    q = _nibbles_k(b[:, 16:144]).astype(np.float32)
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales_mins(b[:, 4:16])
    high = _bits_per_column(b[:, 16:48]).reshape(n, 8, 32)
    q = (_nibbles_k(b[:, 48:176]) | (high << 4)).astype(np.float32)
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # signed 8-bit scales
    d = _f16(b, 208)
    # Per 128-element half h (64 ql bytes, 32 qh bytes), element 32k + l is:
    #   low 4 bits: nibble k//2 of ql[64h + 32*(k%2) + l]
    #   high 2 bits: bits [2k, 2k+2) of qh[32h + l]
    lo = ql.reshape(n, 2, 1, 2, 32) >> _NIBBLE_SHIFT.reshape(1, 1, 2, 1, 1)
    lo = (lo & 0x0F).reshape(n, 2, 4, 32)
    hi = (qh.reshape(n, 2, 1, 32) >> _CRUMB_SHIFT.reshape(1, 1, 4, 1)) & 0x03
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    dl = (d * sc).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


_KERNELS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": _deq_q4_0,
    "Q4_1": _deq_q4_1,
    "Q5_0": _deq_q5_0,
    "Q5_1": _deq_q5_1,
    "Q8_0": _deq_q8_0,
    "Q2_K": _deq_q2_k,
    "Q3_K": _deq_q3_k,
    "Q4_K": _deq_q4_k,
    "Q5_K": _deq_q5_k,
    "Q6_K": _deq_q6_k,
}

# Output elements decoded per kernel call.  The kernels create a handful of
# temporaries of roughly the chunk's size (uint8 and float32), so this bounds
# the extra memory to a few MiB independent of tensor size, while staying
# large enough that numpy's per-call overhead is negligible.
_CHUNK_ELEMS = 1 << 17


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------


def dequantize(
    raw: np.ndarray, qtype: str | int | GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray:
    """Decode ``raw`` GGUF tensor data of type ``qtype`` into float32 ``shape``.

    ``raw`` is normally a uint8 array (of any shape) holding exactly the bytes
    of the tensor's blocks.  For F32 / F16 an already-typed float32 / float16
    array, and for BF16 a uint16 array of the raw bit patterns, is accepted
    too (that is what ``gguf.GGUFReader`` hands out for those types).

    Always returns a new C-contiguous float32 array that does not alias
    ``raw`` (so it stays valid after a memory-mapped file is closed).
    """
    s = spec(qtype)
    try:
        shape = tuple(int(x) for x in shape)
    except TypeError:
        raise ValueError(f"shape must be a tuple of ints, got {shape!r}") from None
    if any(x < 0 for x in shape):
        raise ValueError(f"shape has a negative dimension: {shape}")
    n_cols = shape[-1] if shape else 1
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if shape else 1
    n_elem = n_rows * n_cols
    n_bytes = n_rows * _row_bytes(s, n_cols)  # also checks block alignment

    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"raw must be a numpy array, got {type(raw).__name__}")

    # Already-typed plain-float data: validate the element count and convert.
    typed = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(s.name)
    if typed is not None and raw.dtype != np.uint8:
        if raw.dtype != typed:
            raise ValueError(f"{s.name} data must be uint8 or {np.dtype(typed).name}, got {raw.dtype}")
        if raw.size != n_elem:
            raise ValueError(f"{s.name} data has {raw.size} elements, shape {shape} needs {n_elem}")
        raw = raw.reshape(-1).view(np.uint8)  # back to bytes, handled below
    elif raw.dtype != np.uint8:
        raise ValueError(f"{s.name} data must be a uint8 byte array, got {raw.dtype}")

    if raw.size != n_bytes:
        raise ValueError(f"{s.name} tensor of shape {shape} needs {n_bytes} bytes, got {raw.size}")
    flat = np.ascontiguousarray(raw).reshape(-1)

    if s.name == "F32":
        out = flat.view("<f4").astype(np.float32)  # astype copies
    elif s.name == "F16":
        out = flat.view(_F16).astype(np.float32)
    elif s.name == "BF16":
        # bfloat16 is the top half of an IEEE float32: widen, then shift the
        # bits into place in-place so no second full-size temporary exists.
        bits = flat.view("<u2").astype(np.uint32)
        bits <<= 16
        out = bits.view(np.float32)
    else:
        kernel = _KERNELS[s.name]
        blocks = flat.reshape(-1, s.type_size)
        out = np.empty((blocks.shape[0], s.block_size), dtype=np.float32)
        step = max(1, _CHUNK_ELEMS // s.block_size)
        for i in range(0, blocks.shape[0], step):
            out[i : i + step] = kernel(blocks[i : i + step])
    return out.reshape(shape)
