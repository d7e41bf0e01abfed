"""Integer weights in groups along the input dimension (GPTQ, AWQ, compressed-tensors `pack-quantized`), in the one
row-major layout the engine keeps them in: the "intgroup" family of ir/weight_formats.py.

Each source packs differently (read by ir/formats/int_checkpoints.py); all of them decode to unsigned b-bit q, a
scale s and an integer zero point z per group of G inputs of one output row, w = (q - z) * s. We store each group as
one block of a row, as GGUF does, so that every row-wise transform (row splits of fused tensors, q/k un-permutes,
expert stacks, row-sharding, the backends' row concatenation) works on these tensors unchanged:

    [scale f32][bias f32][q: G * b / 8 bytes]     bias = -z * s; element j of the group at byte j*b/8, low bits first

so a block decodes as q * scale + bias, MLX's affine form: the q bytes are MLX's packed words as they lie. With s an
fp16 or bf16 (every GPTQ and AWQ checkpoint, compressed-tensors' in 16-bit models) and q, z below 256, q * s and z * s
are exact in fp32 and so is their sum, (q - z) * s: the layout loses nothing. Kinds are named `I{bits}_G{group}`.
"""

from __future__ import annotations

import re

import numpy as np

BITS = (4, 8)
HEADER_BYTES = 8  # scale and bias, two f32
_KIND = re.compile(r"^I(\d+)_G(\d+)$")


def kind_name(bits: int, group: int) -> str:
    return f"I{bits}_G{group}"


def parse_kind(kind: str) -> tuple[int, int] | None:
    """(bits, group) of an intgroup kind name, None for any other name; ValueError for one we cannot store."""
    m = _KIND.match(kind)
    if m is None:
        return None
    bits, group = int(m.group(1)), int(m.group(2))
    check(bits, group)
    return bits, group


def check(bits: int, group: int) -> None:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit integer weights: supported widths are {', '.join(map(str, BITS))}")
    if group <= 0 or group % 32:
        raise ValueError(f"integer weight groups of {group}: a group must be a positive multiple of 32 inputs")


def block_bytes(bits: int, group: int) -> int:
    return HEADER_BYTES + group * bits // 8


def pack(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Blocks uint8 [N, K / group * block_bytes] from unsigned q [N, K] and scales, zero points [N, K / group]."""
    check(bits, group)
    n, k = q.shape
    if k % group or scales.shape != (n, k // group) or zeros.shape != scales.shape:
        raise ValueError(f"q {q.shape}, scales {scales.shape} and zeros {zeros.shape} are not groups of {group}")
    if q.size and int(q.max()) >= 1 << bits:
        raise ValueError(f"q values up to {int(q.max())} do not fit {bits} bits")
    g = k // group
    s = np.asarray(scales, np.float32)
    bias = -(np.asarray(zeros, np.float32) * s)
    qg = q.astype(np.uint8).reshape(n, g, group)
    if bits == 4:
        qg = qg[..., 0::2] | (qg[..., 1::2] << 4)
    head = np.stack([s, bias], axis=-1).astype("<f4").view(np.uint8).reshape(n, g, HEADER_BYTES)
    return np.ascontiguousarray(np.concatenate([head, qg], axis=-1).reshape(n, g * block_bytes(bits, group)))


def split(data: np.ndarray, bits: int, group: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q bytes uint8 [rows, cols * bits / 8], scales and biases f32 [rows, cols / group]) of stored blocks."""
    g = cols // group
    blocks = np.ascontiguousarray(data).reshape(rows, g, block_bytes(bits, group))
    head = np.ascontiguousarray(blocks[..., :HEADER_BYTES]).view("<f4").reshape(rows, g, 2)
    qbytes = np.ascontiguousarray(blocks[..., HEADER_BYTES:]).reshape(rows, cols * bits // 8)
    return qbytes, head[..., 0].astype(np.float32), head[..., 1].astype(np.float32)


def unpack_q(qbytes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned q values uint8 [rows, cols] from their bytes (4-bit: low nibble first)."""
    if bits == 8:
        return qbytes
    out = np.empty((qbytes.shape[0], qbytes.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = qbytes & 0x0F, qbytes >> 4
    return out


def dequantize(data: np.ndarray, shape: tuple[int, ...], bits: int, group: int) -> np.ndarray:
    """fp32 values of logical `shape` (columns in stored order) from the blocks."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    qbytes, scales, biases = split(data, bits, group, rows, cols)
    q = unpack_q(qbytes, bits).reshape(rows, cols // group, group).astype(np.float32)
    return (q * scales[..., None] + biases[..., None]).reshape(shape)


def quantize_rtn(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Blocks of w [N, K] rounded to nearest in asymmetric groups, GPTQ's RTN baseline (its Quantizer, sym=False):
    the range [min(w, 0), max(w, 0)] (so 0 is exact and z in [0, 2^b - 1]), s = range / (2^b - 1) rounded to fp16 as
    GPTQ/AWQ checkpoints store it (the layout is then exact), z = round(-min / s), q = clip(round(w / s) + z)."""
    check(bits, group)
    n, k = w.shape
    if k % group:
        raise ValueError(f"rows of {k} values are not a whole number of {group}-value groups")
    top = (1 << bits) - 1
    x = np.asarray(w, np.float32).reshape(n, k // group, group)
    if not np.isfinite(x).all():
        raise ValueError("integer quantization: NaN or infinite values have no code")
    lo, hi = np.minimum(x.min(axis=-1), 0), np.maximum(x.max(axis=-1), 0)
    zero = (lo == 0) & (hi == 0)  # an all-zero group: GPTQ's range [-1, 1] (it still decodes to exact zeros)
    lo, hi = np.where(zero, np.float32(-1), lo), np.where(zero, np.float32(1), hi)
    s = ((hi - lo) / np.float32(top)).astype(np.float16).astype(np.float32)
    s = np.where(np.isfinite(s) & (s > 0), s, (hi - lo) / np.float32(top)).astype(np.float32)  # beyond fp16: f32
    z = np.clip(np.rint(-lo / s), 0, top)
    q = np.clip(np.rint(x / s[..., None]) + z[..., None], 0, top).astype(np.uint8)
    return pack(q.reshape(n, k), s, z, bits, group)
