"""Rows of a raw GGUF matrix dequantized, out[i, :] = dequantize(w[rows[i], :]): DSL kernel, launcher, reference.

Two uses: the embedding lookup of a quantized token table (rows = token ids), and a chunk of a quantized weight
expanded for a GEMM in prefill (rows = arange). Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K (layouts in ir/formats/gguf_quants.py). The kernel is bound by memory, mostly the writes (2 or 4 bytes an
element against 0.33 to 1.06 read), so:
- A program takes BLOCKS consecutive blocks of one row (grid: rows x tiles of a row). The tiles' last axis runs
  along the output, 16 or 32 elements, so a thread stores 16-byte vectors; the quant bytes it needs are as
  contiguous and are loaded once for both nibbles (Triton widens the loads as far as the blocks' 2-byte
  alignment allows; Q4_K's quants are 16-byte aligned).
- A quant becomes a float without an int-to-float conversion (quarter rate on NVIDIA GPUs): masked in place,
  OR-ed into the mantissa of 2**23, read as a float and offset by one subtraction, which gives (q - offset) *
  2**shift exactly; the block scale comes pre-divided by 2**shift. A quant's high bits kept apart (Q5's fifth,
  Q3_K's third, Q6_K's top two) are shifted just above its low ones first. So every value is the reference's
  (d * scale) * (q - offset) bit for bit (a GPU may fuse a minimum, Q4_1's, Q5_1's, Q2_K's, Q4_K's, Q5_K's, into
  an FMA).
- Blocks past the row's end (the last tile of a row) load the last block again and are not stored.
Row ids are not checked on the device: each must lie in [0, w.shape[0]) (the numpy target raises IndexError on
one that reads outside w; a GPU reads whatever lies there).
"""

from __future__ import annotations

import numpy as np

from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src.dequant_gemv import FORMATS, QTYPES
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.dsl.ir import dtype_of

__all__ = ["QTYPES", "default_blocks", "dequantize_rows", "dequantize_rows_kernel", "dequantize_rows_ref"]

MAGIC = 0x4B000000  # fp32 bits of 2**23: an integer below 2**23 in its mantissa reads as 2**23 + that integer


def _quant(v, mask: int, offset: int = 0):
    """(v & mask) - offset * lowbit(mask), as fp32 (exact: the field stays below 2**23)."""
    low = mask & -mask
    return ((v & mask) | MAGIC).to(tl.float32, bitcast=True) - float(2 ** 23 + offset * low)


def _bytes(p):
    return tl.load(p).to(tl.uint32)


def _f16(blk, off: int):
    """The fp16 field at byte `off` of each block (blocks are 2-byte aligned), as fp32."""
    return tl.load((blk + off).to(tl.pointer_type(tl.float16))).to(tl.float32)


# Each format maps its blocks (a [BLOCKS, 1, ..] tile of pointers to their first byte) to [(element offsets within
# the block, values)], the offsets contiguous along the last axis.

def _q4(blk, QTYPE: str):
    """Q4_0 (d, 16 bytes), Q4_1 (d, m, 16 bytes): element e is the low nibble of byte e, 16 + e its high nibble."""
    e = tl.arange(0, 16)[None, :]
    v = _bytes(blk + (4 if QTYPE == "Q4_1" else 2) + e)
    d = _f16(blk, 0)
    if QTYPE == "Q4_0":
        return [(e, _quant(v, 0x0F, 8) * d), (16 + e, _quant(v, 0xF0, 8) * (d * 0.0625))]
    m = _f16(blk, 2)
    return [(e, _quant(v, 0x0F) * d + m), (16 + e, _quant(v, 0xF0) * (d * 0.0625) + m)]


def _q5(blk, QTYPE: str):
    """Q5_0 (d, qh, 16 bytes), Q5_1 (d, m, qh, 16 bytes): Q4's nibbles with bit e (16 + e) of the 32-bit qh moved
    just above element e's (16 + e's)."""
    e = tl.arange(0, 16)[None, :]
    head = 4 if QTYPE == "Q5_1" else 2
    v = _bytes(blk + head + 4 + e)
    top = [_bytes(blk + head + 2 * n + (e >> 3)) >> (e & 7) for n in range(2)]  # bit 0: qh bit e (16 + e)
    lo, hi = (v & 0x0F) | ((top[0] << 4) & 0x10), (v & 0xF0) | ((top[1] << 8) & 0x100)
    d = _f16(blk, 0)
    if QTYPE == "Q5_0":
        return [(e, _quant(lo, 0x1F, 16) * d), (16 + e, _quant(hi, 0x1F0, 16) * (d * 0.0625))]
    m = _f16(blk, 2)
    return [(e, _quant(lo, 0x1F) * d + m), (16 + e, _quant(hi, 0x1F0) * (d * 0.0625) + m)]


def _q8(blk):
    """Q8_0 (d, 32 int8): int8 q + 128 is its byte with the top bit flipped."""
    e = tl.arange(0, 32)[None, :]
    return [(e, _quant(_bytes(blk + 2 + e) ^ 0x80, 0xFF, 128) * _f16(blk, 0))]


def _k4_head(blk, WORDS: bool):
    """(d, dmin, scale words) of Q4_K / Q5_K blocks: fp16 loads and None, or (WORDS: blocks 4-byte aligned) the
    header's four 32-bit words, which Triton's pipeliner can stage with cp.async (2-byte and byte loads it leaves
    synchronous: dequant_gemm's step waited on them)."""
    if not WORDS:
        return _f16(blk, 0), _f16(blk, 2), None
    w = blk.to(tl.pointer_type(tl.uint32))
    head = tl.load(w)
    return _half(head), _half(head >> 16), [tl.load(w + i) for i in (1, 2, 3)]


def _half(u):
    return (u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


def _k4_scales(blk, c, h: int, d, dmin, sw=None):
    """(d * scale, dmin * min) of sub-block s = 2c + h of Q4_K and Q5_K (12 bytes at 4): 6 bits in bytes s % 4 (and
    4 + s % 4) for sub-blocks 0-3; 4 from byte 8 + s % 4 and 2 from the top of bytes 0-7 for 4-7. sw: the three
    scale words (_k4_head's), else the bytes are loaded."""
    low = c < 2
    j = 2 * (c & 1) + h
    if sw is None:
        x0, x1, x2 = _bytes(blk + 4 + j), _bytes(blk + 8 + j), _bytes(blk + 12 + j)
    else:
        x0, x1, x2 = ((word >> (8 * j).to(tl.uint32)) & 0xFF for word in sw)
    sc = tl.where(low, x0 & 63, (x2 & 15) | ((x0 >> 6) << 4)).to(tl.float32)
    mn = tl.where(low, x1 & 63, (x2 >> 4) | ((x1 >> 6) << 4)).to(tl.float32)
    return d * sc, dmin * mn


def _q4k(blk, WORDS: bool = False):
    """Q4_K (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes): byte e of chunk c holds element 64c + e (low
    nibble, sub-block 2c) and 64c + 32 + e (high nibble, sub-block 2c + 1). Tiles [BLOCKS, 4 chunks, 32]."""
    c = tl.arange(0, 4)[None, :, None]
    e = tl.arange(0, 32)[None, None, :]
    v = _bytes(blk + 16 + 32 * c + e)
    d, dmin, sw = _k4_head(blk, WORDS)
    out = []
    for h in range(2):
        ds, dm = _k4_scales(blk, c, h, d, dmin, sw)
        out.append((64 * c + 32 * h + e, _quant(v, 0xF0 if h else 0x0F) * (ds * (0.0625 if h else 1.0)) - dm))
    return out


def _q5k(blk, WORDS: bool = False):
    """Q5_K (Q4_K's header, qh[32], 128 bytes as Q4_K's): element 64c + 32h + e takes bit 2c + h of qh[e] on top of
    its nibble; shifted into place above the nibble, the 5-bit value is read in place like Q4_K's."""
    c = tl.arange(0, 4)[None, :, None]
    e = tl.arange(0, 32)[None, None, :]
    v = _bytes(blk + 48 + 32 * c + e)
    top = _bytes(blk + 16 + e) >> (2 * c)  # bit 0 (1): the fifth bit of sub-block 2c (2c + 1)
    q = ((v & 0x0F) | ((top << 4) & 0x10), (v & 0xF0) | ((top << 7) & 0x100))
    d, dmin, sw = _k4_head(blk, WORDS)
    out = []
    for h in range(2):
        ds, dm = _k4_scales(blk, c, h, d, dmin, sw)
        out.append((64 * c + 32 * h + e, _quant(q[h], 0x1F0 if h else 0x1F) * (ds * (0.0625 if h else 1.0)) - dm))
    return out


def _halves(WIDE: bool):
    """(h, g, i, e) tiles of the 16-element sub-block formats: [BLOCKS, 2 halves, G, 32 / G], e = 32 / G * g + i.
    WIDE (G = 1) picks each element's scale of two: for Q6_K, 84% of copy bandwidth on an H200 with Triton against
    74% at G = 2, but 15% against 73% through the SIMT lowering."""
    g_n, i_n = (1, 32) if WIDE else (2, 16)
    h, g = tl.arange(0, 2)[None, :, None, None], tl.arange(0, g_n)[None, None, :, None]
    i = tl.arange(0, i_n)[None, None, None, :]
    return h, g, i, i_n * g + i


def _sub_scale(i, WIDE: bool, scale):
    """scale(u) of the element's sub-block 2k + u (u = l // 16 within the half's pair): g, or i >= 16 when WIDE."""
    return tl.where(i < 16, scale(0), scale(1)) if WIDE else scale(0)


def _q6k(blk, WIDE: bool):
    """Q6_K (ql[128], qh[64], int8 scales[16], d): in half h, element 128h + 32k + e is nibble k // 2 of
    ql[64h + 32(k % 2) + e] plus bits 2k, 2k + 1 of qh[32h + e] on top, minus 32, times scale 8h + 2k + e // 16."""
    h, g, i, e = _halves(WIDE)
    ql = [_bytes(blk + 64 * h + 32 * j + e) for j in range(2)]
    qh = _bytes(blk + 128 + 32 * h + e)
    qh = [qh << (4 - 2 * j) for j in range(2)]  # bits 2k, 2k + 1 moved just above nibble k // 2 of ql (k = 2n + j)
    d = _f16(blk, 208)
    sc = blk.to(tl.pointer_type(tl.int8)) + 192 + 8 * h + g
    out = []
    for k in range(4):
        n, j = divmod(k, 2)
        q = (ql[j] & (0x0F << 4 * n)) | (qh[j] & (0x30 << 4 * n))  # q * 16**n, in place
        ds = _sub_scale(i, WIDE, lambda u, k=k, n=n: d * tl.load(sc + 2 * k + u).to(tl.float32) * 0.0625 ** n)
        out.append((128 * h + 32 * k + e, _quant(q, 0x3F << 4 * n, 32) * ds))
    return out


def _q2k(blk, WIDE: bool):
    """Q2_K (scales[16]: 4-bit scale | 4-bit min << 4, qs[64], d, dmin): in half h, element 128h + 32k + e is bits
    2k, 2k + 1 of qs[32h + e] (read in place, the scale pre-divided by 4**k), times d * scale - dmin * min of
    sub-block 8h + 2k + e // 16."""
    h, g, i, e = _halves(WIDE)
    v = _bytes(blk + 16 + 32 * h + e)
    d, dmin = _f16(blk, 80), _f16(blk, 82)
    out = []
    for k in range(4):
        s = _sub_scale(i, WIDE, lambda u, k=k: _bytes(blk + 8 * h + 2 * k + g + u))
        ds, dm = d * (s & 15).to(tl.float32), dmin * (s >> 4).to(tl.float32)
        out.append((128 * h + 32 * k + e, _quant(v, 3 << 2 * k) * (ds * 0.25 ** k) - dm))
    return out


def _q3k(blk, WIDE: bool):
    """Q3_K (hmask[32], qs[64], 12 bytes of 6-bit scales, d): in half h, element 128h + 32k + e is bits 2k, 2k + 1
    of qs[32h + e] plus bit 4h + k of hmask[e] on top (moved there), minus 4, times d * (scale - 32) of sub-block
    8h + 2k + e // 16, whose low 4 bits are nibble h of byte 2k + e // 16 and top 2 bits 4h + 2 (k // 2) of byte
    8 + 2 (k % 2) + e // 16."""
    h, g, i, e = _halves(WIDE)
    v = _bytes(blk + 32 + 32 * h + e)
    hm = _bytes(blk + e) >> (4 * h)
    d = _f16(blk, 108)
    out = []
    for k in range(4):
        q = (v & (3 << 2 * k)) | ((hm << (k + 2)) & (4 << 2 * k))
        s = _sub_scale(i, WIDE, lambda u, k=k: ((_bytes(blk + 96 + 2 * k + g + u) >> (4 * h)) & 15) | (
            ((_bytes(blk + 104 + 2 * (k % 2) + g + u) >> (4 * h + 2 * (k // 2))) & 3) << 4))
        ds = d * (s.to(tl.float32) - 32.0)
        out.append((128 * h + 32 * k + e, _quant(q, 7 << 2 * k, 4) * (ds * 0.25 ** k)))
    return out


WORD_HEADS = ("Q4_K", "Q5_K")  # formats whose decoders can read their header as 32-bit words (WORDS)


def _family(QTYPE: str, WIDE: bool, WORDS: bool = False):
    """(tile rank, decode) of a format; WORDS (WORD_HEADS only): headers read as 32-bit words."""
    if QTYPE in ("Q4_K", "Q5_K"):
        return 3, lambda b: (_q4k if QTYPE == "Q4_K" else _q5k)(b, WORDS)
    if QTYPE in ("Q2_K", "Q3_K", "Q6_K"):
        return 4, lambda b: {"Q2_K": _q2k, "Q3_K": _q3k, "Q6_K": _q6k}[QTYPE](b, WIDE)
    if QTYPE == "Q8_0":
        return 2, _q8
    return 2, lambda b: (_q5 if QTYPE in ("Q5_0", "Q5_1") else _q4)(b, QTYPE)


def dequantize_rows_kernel(w, rows, out, n_blocks, w_stride, out_stride, QTYPE: tl.constexpr,
                           BLOCKS: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr = False):
    elems, size = FORMATS[QTYPE]
    rank, decode = _family(QTYPE, WIDE)
    i = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    for _ in range(rank - 1):
        b = b[:, None]
    if PDL:  # the row ids may be a kernel's output (token ids); w is read through them, so after the wait too
        tl.wait_prior_grid()
        tl.launch_dependents()
    row = tl.load(rows + i).to(tl.int64)
    blk = w + row * w_stride + tl.minimum(b, n_blocks - 1) * size  # past the end: the last block, not stored
    dst = out + i.to(tl.int64) * out_stride + b * elems
    for off, val in decode(blk):
        tl.store(dst + off, val, mask=b < n_blocks)


# --- host side -------------------------------------------------------------------------------------------------

WIDE_TARGETS = ("numpy", "triton", "triton-interpret")  # 32-wide tiles (see _halves); not the SIMT targets
ELEMS = 4096  # elements a program writes (32 a thread at 4 warps): 91-94% of copy bandwidth on an H200


def default_blocks(qtype: str, k: int) -> int:
    """BLOCKS of a row of k elements: ELEMS elements, fewer where the row is shorter."""
    elems = FORMATS[qtype.upper()][0]
    return max(1, min(ELEMS // elems, tl.next_power_of_2(k // elems)))


_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _dtype_name(dtype) -> str:
    """"float32" / "float16" / "bfloat16" for such a name or a numpy / torch dtype."""
    name = _NAMES.get(str(dtype_of(np.dtype(dtype) if isinstance(dtype, type) else dtype)))
    if name is None:
        raise ValueError(f"outputs are fp32, fp16 or bf16, not {dtype}")
    return name


def _addr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


def dequantize_rows(w, rows, qtype: str, k: int, *, out=None, dtype: object = None, blocks: int | None = None,
                    num_warps: int = 4, target: str = "numpy", pdl: bool | None = None):
    """out [R, k] = dequantize(w[rows]) for raw GGUF blocks w (uint8 [N, >= row_bytes], rows strided, bytes
    contiguous) and integer rows [R] (each in [0, N): not checked on the device). out: fp32 / fp16 / bf16 rows
    (strided, elements contiguous), made next to w when not given, in `dtype` (a name, numpy or torch dtype;
    fp32 by default)."""
    qtype = qtype.upper()
    if qtype not in FORMATS:
        raise ValueError(f"unsupported qtype {qtype!r} (supported: {', '.join(QTYPES)})")
    elems = FORMATS[qtype][0]
    if k <= 0 or k % elems or len(w.shape) != 2 or w.shape[1] < row_bytes(qtype, k) or elem_stride(w, 1) != 1:
        raise ValueError(f"{qtype} weights {tuple(w.shape)} do not hold rows of {k} elements")
    if _addr(w) % 2 or elem_stride(w, 0) % 2:
        raise ValueError("weight rows must start 2-byte aligned (the blocks' fp16 scales are read as such)")
    if len(rows.shape) != 1:
        raise ValueError(f"rows must be 1-d, got shape {tuple(rows.shape)}")
    r = rows.shape[0]
    out = empty(w, (r, k), _dtype_name(dtype or "float32")) if out is None else out
    if tuple(out.shape) != (r, k) or (r and elem_stride(out, 1) != 1):  # (empty arrays have 0 strides)
        raise ValueError(f"out {tuple(out.shape)} is not [{r}, {k}] with contiguous rows")
    if r == 0:
        return out
    n_blocks = k // elems
    bl = blocks or default_blocks(qtype, k)
    pdl = use_pdl(target, pdl)
    kern = compile(dequantize_rows_kernel, target, num_warps=num_warps, launch_pdl=pdl, QTYPE=qtype, BLOCKS=bl,
                   WIDE=target in WIDE_TARGETS, PDL=pdl)
    kern[r, tl.cdiv(n_blocks, bl)](w, rows, out, n_blocks, elem_stride(w, 0), elem_stride(out, 0))
    return out


def dequantize_rows_ref(w: np.ndarray, rows: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """fp32 [R, k]: our numpy dequantizer on the selected rows."""
    sel = np.asarray(w)[np.asarray(rows, np.int64)][:, :row_bytes(qtype, k)]
    return dequantize(np.ascontiguousarray(sel), qtype, (sel.shape[0], k))
