"""FP8 (e4m3) weights with a float scale per block of inputs (DeepSeek-V3 / Qwen3-FP8 128x128 blocks, compressed-tensors
`float-quantized` per-tensor, per-channel and block scales), in the one row-major layout the engine keeps them in:
the "fp8" family of ir/weight_formats.py.

Every source's scale covers a rectangle of [rows, inputs] (a 128x128 block, a row, the whole tensor). We store the
scale with every row it covers, once per group of G inputs, so that each row is whole on its own, as GGUF and the
intgroup layout are, and every row-wise transform (fused-tensor splits, q/k un-permutes, expert stacks, row shards)
works on these tensors unchanged:

    [scale f32][G e4m3 bytes]     w = e4m3 value * scale

G divides the row (a source block of 128 inputs over a row of 192 becomes groups of 64, each with its block's
scale), so repeating a scale is exact. Kinds are named `F8E4M3_G{group}`.
"""

from __future__ import annotations

import re
from math import gcd

import numpy as np

HEADER_BYTES = 4  # the scale, one f32
E4M3_MAX = 448.0  # the largest finite e4m3 value (S.1111.110)
_KIND = re.compile(r"^F8E4M3_G(\d+)$")


def _e4m3_table() -> np.ndarray:
    """fp32 value of each of the 256 e4m3 (OCP FP8, "fn": no infinities) bytes, from the format's definition:
    sign bit, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2**-6); S.1111.111 is NaN."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0x0F, b & 0x07
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


E4M3 = _e4m3_table()


def kind_name(group: int) -> str:
    return f"F8E4M3_G{group}"


def parse_kind(kind: str) -> int | None:
    """The group of an fp8 kind name, None for any other name."""
    m = _KIND.match(kind)
    if m is None:
        return None
    group = int(m.group(1))
    check(group)
    return group


def check(group: int) -> None:
    if group <= 0 or group % 16:
        raise ValueError(f"FP8 weight groups of {group}: a group must be a positive multiple of 16 inputs")


def block_bytes(group: int) -> int:
    return HEADER_BYTES + group


def decode(codes: np.ndarray) -> np.ndarray:
    """fp32 values of e4m3 bytes (uint8), exactly."""
    return E4M3[np.asarray(codes, np.uint8)]


def encode(x: np.ndarray) -> np.ndarray:
    """e4m3 bytes (uint8) of finite values, rounded to nearest, ties to even, from the format's definition; beyond
    +-448 saturated to +-448 (torch's float8_e4m3fn cast makes NaN of |x| > 464). NaN and infinities: ValueError."""
    x = np.asarray(x, np.float32)
    if not np.isfinite(x).all():
        raise ValueError("e4m3 encoding: NaN or infinite values have no e4m3 code here (saturating them would hide "
                         "the bad weight)")
    a = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    # Normal e4m3 values (from 2**-6) are f32 values with 3 mantissa bits: round the f32 bits to nearest even at bit
    # 20 (a carry moves into the exponent, as it should), then rebias the exponent from 127 to 7.
    u = a.view(np.uint32)
    normal = ((u + np.uint32(0x7FFFF) + ((u >> 20) & 1)) >> 20).astype(np.int32) - ((127 - 7) << 3)
    # Subnormals are multiples of 2**-9 (a * 512 is exact; np.rint is half to even); 8 * 2**-9 is code 8, 2**-6.
    sub = np.rint(a * np.float32(512)).astype(np.int32)
    code = np.where(a >= np.float32(2.0 ** -6), normal, sub).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


def pack_block_scales(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, int]:
    """(blocks, group) of e4m3 bytes [N, K] with one scale per [bn, bk] block of them (scales [ceil(N / bn),
    ceil(K / bk)], edge blocks partial): groups of gcd(K, bk) inputs tile both the row and each block."""
    (n, k), (bn, bk) = codes.shape, block
    group = gcd(k, bk)
    per_row = scales.reshape(-(-n // bn), -(-k // bk))[np.arange(n) // bn][:, np.arange(0, k, group) // bk]
    return pack(codes, per_row, group), group


def quantize_blockwise(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, int]:
    """(blocks, group) of a matrix [N, K] as DeepSeek-V3 quantizes it: per [bn, bk] block (edge blocks partial)
    scale = max |w| / 448 in f32 (1 for an all-zero block), codes = e4m3(w / scale)."""
    (n, k), (bn, bk) = w.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    w = np.asarray(w, np.float32)
    if (nb * bn, kb * bk) != (n, k):  # partial edge blocks: zeros change no block's max
        w = np.pad(w, ((0, nb * bn - n), (0, kb * bk - k)))
    b = w.reshape(nb, bn, kb, bk)
    amax = np.abs(b).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    codes = encode(b / scales[:, None, :, None]).reshape(nb * bn, kb * bk)[:n, :k]
    return pack_block_scales(np.ascontiguousarray(codes), scales, block)


def pack(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """Blocks uint8 [N, K / group * block_bytes] from e4m3 bytes [N, K] and f32 scales [N, K / group]."""
    check(group)
    n, k = codes.shape
    if k % group or scales.shape != (n, k // group):
        raise ValueError(f"e4m3 weights {codes.shape} with scales {scales.shape} are not groups of {group}")
    g = k // group
    head = np.ascontiguousarray(scales, "<f4").view(np.uint8).reshape(n, g, HEADER_BYTES)
    body = np.asarray(codes, np.uint8).reshape(n, g, group)
    return np.ascontiguousarray(np.concatenate([head, body], axis=-1).reshape(n, g * block_bytes(group)))


def split(data: np.ndarray, group: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bytes uint8 [rows, cols], scales f32 [rows, cols / group]) of stored blocks."""
    g = cols // group
    blocks = np.ascontiguousarray(data).reshape(rows, g, block_bytes(group))
    scales = np.ascontiguousarray(blocks[..., :HEADER_BYTES]).view("<f4").reshape(rows, g)
    return np.ascontiguousarray(blocks[..., HEADER_BYTES:]).reshape(rows, cols), scales


def dequantize(data: np.ndarray, shape: tuple[int, ...], group: int) -> np.ndarray:
    """fp32 values of logical `shape` from the blocks."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    codes, scales = split(data, group, rows, cols)
    w = decode(codes).reshape(rows, cols // group, group) * scales[..., None]
    return w.reshape(shape)
