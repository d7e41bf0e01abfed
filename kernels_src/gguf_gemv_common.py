"""What the dequantizing GEMV's formats share (kernels_src/dequant_gemv.py explains the design): quant fields read
as floats (`_Decode`), x read as words of 16-bit pairs and quads, the lane's 16-byte word vectors, and sums."""

from __future__ import annotations

from kernels_src.dsl import tl


class _Decode:
    """Quant fields as floats, and x scaled to meet them: products come out at field * x * 2**-xs."""

    def __init__(self, subnormal: bool):
        self.subnormal = subnormal
        self.xs = 64 if subnormal else 0  # keeps subnormal products normal; needs |x| < 2**(64 - 21)
        self.unit = 2.0 ** self.xs  # what a block scale is multiplied by

    def q(self, word, shift: int, width: int):
        """word[shift : shift + width] as field * 2**shift (times 2**-149 as a subnormal); shift + width <= 23."""
        f = word & (((1 << width) - 1) << shift)
        if self.subnormal:
            return f.to(tl.float32, bitcast=True)
        return (f | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    def x(self, v, shift: int):
        return v * 2.0 ** ((149 if self.subnormal else 0) - shift - self.xs)


# --- shared helpers ----------------------------------------------------------------------------------------------

def _f16(u):
    """fp16 bits in the low half of an integer tile, as fp32."""
    return (u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


def _x_vals(xm, idx, n: int, mask=None):
    """x[n * idx + k] for k < n as fp32 tiles; 16-bit x is read as one 32- (n = 2) or 64-bit (n = 4) word. Where
    `mask` is False the values are 0 (and the addresses are not read)."""
    el = xm.dtype.elem
    load = tl.load if mask is None else (lambda p: tl.load(p, mask=mask, other=0))
    if el.bits != 16:
        return [load(xm + n * idx + k).to(tl.float32) for k in range(n)]
    word = load(xm.to(tl.pointer_type(tl.uint32 if n == 2 else tl.uint64)) + idx)
    halves = [word] if n == 2 else [word.to(tl.uint32), (word >> 32).to(tl.uint32)]
    if el == tl.bfloat16:
        return [v.to(tl.float32, bitcast=True) for h in halves for v in (h << 16, h & 0xFFFF0000)]
    return [_f16(h >> s) for h in halves for s in (0, 16)]


def _add(tiles):
    out = tiles[0]
    for t in tiles[1:]:
        out = out + t
    return out


def _dot(qs, xs):
    """sum_k qs[k] * xs[k], summed over the lane's words (the last axis)."""
    return tl.sum(_add([q * v for q, v in zip(qs, xs, strict=True)]), axis=-1, keep_dims=True)


def _rsum(xs):
    return tl.sum(_add(xs), axis=-1, keep_dims=True)


def _u16(p, mask=None):
    """16-bit words as uint32; masked ones (scale fields) read 0."""
    return (tl.load(p) if mask is None else tl.load(p, mask=mask, other=0)).to(tl.uint32)


def _words(n: int, parts: int, rank: int = 3):
    """Word indices of a block, one [1, .., n / (4 parts), 4] tile per part: lane g owns the 4-word vectors g,
    G + g, .. (G = n / (4 parts)), so a lane's loads are 16 bytes wide and neighbouring lanes' are contiguous."""
    g = n // (4 * parts)
    idx = tl.arange(0, g)[:, None] * 4 + tl.arange(0, 4)[None, :]
    for _ in range(rank - 2):
        idx = idx[None]
    return [4 * g * p + idx for p in range(parts)]
