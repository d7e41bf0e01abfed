"""GGUF block quantizations rewritten, exactly, as MLX affine group quantization.

MLX stores a matrix as groups of `group_size` consecutive elements of a row, each decoded as
`w = scale * q + bias`, with the unsigned `bits`-wide q packed as one little-endian bit stream per row
(element j at bits (j*bits) % 32 of uint32 word (j*bits) // 32; 3/5/6-bit values straddle words).
The 32-element legacy quants and the 32-element sub-blocks of Q4_K/Q5_K are such groups:

    Q4_0  d*(q-8)          -> scale d,      bias -8d
    Q5_0  d*(q-16)         -> scale d,      bias -16d
    Q8_0  d*q, q signed    -> q+128 (8 bits), scale d, bias -128d
    Q4_1  d*q + m          -> scale d,      bias m         (Q5_1 likewise, 5 bits)
    Q4_K  d*sc*q - dmin*m  -> scale d*sc,   bias -(dmin*m) (Q5_K likewise, 5 bits)

Every product of an fp16 by these small integers fits float32's 24-bit mantissa, so `scale * q` is
exact and the single rounding left is the add, the same one ggml's dequantizer does: mx.dequantize
equals `StoredTensor.dequantize()` exactly (Q4_0/Q5_0/Q8_0 may differ only in the sign of a zero).
Q2_K, Q3_K and Q6_K scale every 16 elements, finer than MLX's smallest group (32): they stay dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# The layouts are decoded by the same helpers as our reference dequantizer, so the two cannot drift.
from ir.formats.gguf_quants import (
    QTYPES,
    _bits_per_column,
    _f16,
    _k4_scales_mins,
    _nibbles_k,
    _nibbles_lo_then_hi,
    _q5_values,
)
from ir.weights import StoredTensor

__all__ = ["AffineWeight", "GROUP_SIZE", "pack_bits", "to_affine"]

GROUP_SIZE = 32
_UNMAPPABLE = {
    "Q2_K": "16-element sub-blocks, each with its own scale and min; MLX groups are at least 32 wide",
    "Q3_K": "16-element sub-blocks, each with its own scale; MLX groups are at least 32 wide",
    "Q6_K": "16-element sub-blocks, each with its own scale; MLX groups are at least 32 wide",
}
# Blocks decoded per step: bounds the temporaries to a few MiB whatever the tensor's size.
_CHUNK_ELEMS = 1 << 18


@dataclass
class AffineWeight:
    wq: np.ndarray  # uint32 [out, in*bits//32]
    scales: np.ndarray  # float32 [out, in//group_size]
    biases: np.ndarray  # float32 [out, in//group_size]
    group_size: int
    bits: int


# Each decoder takes C-contiguous uint8 blocks (n, type_size) and returns
# q: uint8 (n, block_size) in element order, scales and biases: float32 (n, block_size // 32).
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]


def _q4_0(b: np.ndarray) -> _Decoded:
    d = _f16(b, 0)
    return _nibbles_lo_then_hi(b[:, 2:18]), d, d * np.float32(-8)


def _q4_1(b: np.ndarray) -> _Decoded:
    return _nibbles_lo_then_hi(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> _Decoded:
    d = _f16(b, 0)
    return _q5_values(b[:, 2:6], b[:, 6:22]), d, d * np.float32(-16)


def _q5_1(b: np.ndarray) -> _Decoded:
    return _q5_values(b[:, 4:8], b[:, 8:24]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> _Decoded:
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(0x80), d, d * np.float32(-128)  # int8 x -> unsigned x + 128


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # ggml computes (d*sc)*q - dmin*m; a - b is a + (-b) bit for bit, so the bias is -(dmin*m).
    sc, mn = _k4_scales_mins(b[:, 4:16])
    return _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q4_k(b: np.ndarray) -> _Decoded:
    return _nibbles_k(b[:, 16:144]).reshape(b.shape[0], 256), *_k_scales(b)


def _q5_k(b: np.ndarray) -> _Decoded:
    high = _bits_per_column(b[:, 16:48]).reshape(b.shape[0], 8, 32)
    q = _nibbles_k(b[:, 48:176]) | (high << 4)
    return q.reshape(b.shape[0], 256), *_k_scales(b)


_DECODERS: dict[str, tuple[int, Callable[[np.ndarray], _Decoded]]] = {
    "Q4_0": (4, _q4_0),
    "Q4_1": (4, _q4_1),
    "Q5_0": (5, _q5_0),
    "Q5_1": (5, _q5_1),
    "Q8_0": (8, _q8_0),
    "Q4_K": (4, _q4_k),
    "Q5_K": (5, _q5_k),
}


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values < 2**bits, (n, k) with k % 32 == 0 -> MLX's packed uint32 (n, k*bits//32)."""
    n, k = q.shape
    if bits == 8:
        packed = q
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
    else:
        # Eight values fill exactly `bits` bytes: two uint32 halves of four, joined in a little-endian
        # uint64 whose low `bits` bytes are kept (fewer wide temporaries than eight uint64 shifts).
        g = q.reshape(n, k // 8, 2, 4).astype("<u4")
        half = g[..., 0] | (g[..., 1] << bits) | (g[..., 2] << 2 * bits) | (g[..., 3] << 3 * bits)
        v = half[..., 0].astype("<u8") | (half[..., 1].astype("<u8") << np.uint64(4 * bits))
        packed = v.view(np.uint8).reshape(n, k // 8, 8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(n, k * bits // 8).view("<u4").astype(np.uint32, copy=False)


def to_affine(t: StoredTensor) -> AffineWeight | str:
    """The MLX affine form of a GGUF-quantized matrix (or stack of them: experts [E, out, in], as gather_qmm takes),
    or the reason it must fall back to dense."""
    if not t.quantized:
        return f"{t.kind}: not quantized"
    if t.kind not in _DECODERS:
        return f"{t.kind}: " + _UNMAPPABLE.get(t.kind, "no exact MLX affine form")
    if len(t.shape) < 2:
        return f"{t.kind}: shape {t.shape} is not a matrix"
    *lead, cols = t.shape
    rows = int(np.prod(lead))
    if cols % GROUP_SIZE:
        return f"{t.kind}: row length {cols} is not a multiple of {GROUP_SIZE}"
    bits, decode = _DECODERS[t.kind]
    s = QTYPES[t.kind]
    blocks = np.ascontiguousarray(t.data).reshape(-1, s.type_size)
    nb = rows * cols // s.block_size
    if blocks.shape[0] != nb:
        raise ValueError(f"{t.kind} tensor of shape {t.shape} needs {nb} blocks, got {blocks.shape[0]}")
    groups = s.block_size // GROUP_SIZE
    wq = np.empty((nb, s.block_size * bits // 32), np.uint32)
    scales = np.empty((nb, groups), np.float32)
    biases = np.empty((nb, groups), np.float32)
    step = max(1, _CHUNK_ELEMS // s.block_size)
    for i in range(0, nb, step):
        q, sc, bi = decode(blocks[i : i + step])
        wq[i : i + step] = pack_bits(q, bits)
        scales[i : i + step] = sc
        biases[i : i + step] = bi
    per_row = cols // GROUP_SIZE
    return AffineWeight(wq.reshape(*lead, cols * bits // 32), scales.reshape(*lead, per_row),
                        biases.reshape(*lead, per_row), GROUP_SIZE, bits)
