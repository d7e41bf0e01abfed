"""Dequantizing GEMV y[M, N] = x[M, K] @ W.T (M <= 8) straight from GGUF blocks: DSL kernel, launcher, reference.

W is the raw bytes [N, row_bytes] (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; layouts in ir/formats/gguf_quants.py). The GEMV
streams W once and is bound by memory, so the kernel spends few instructions per quant and keeps loads in flight:
- A program (one warp) takes ROWS rows, unrolled, and walks K STEP blocks at a time; each step's loads (W for
  every row, x once) come before its arithmetic, so they are in flight together. A lane owns PARTS vectors of 4
  consecutive words of one block (32-bit for Q4_K, whose 144-byte super-blocks keep 16-byte alignment; 16-bit
  for the others, whose blocks are only 2-byte aligned) and the x elements that meet them. x is converted once
  per step and reused by every row.
- A quant field is masked in place, never shifted down, and read as a float (`_Decode`): its bits as an fp32
  subnormal where the target has IEEE subnormals (Triton), so a quant costs one LOP3 and one FMA; or OR-ed into
  2**23 and the 2**23 subtracted (SIMT targets: CuPy compiles with -ftz=true, Metal flushes subnormals). x is
  pre-scaled once per step to meet each field position.
- Offsets and minimums (Q4_0's -8, Q4_1's m, Q8_0's sign, Q4_K's mins, Q6_K's -32) are applied once per block
  through sums of x; scales multiply once per lane and block, after the lane's quants are summed.
- Only scale fields are masked (to 0); quant words and x are read through clamped addresses (past the end: the last
  block again), since a block whose scales read as 0 adds nothing. That saves zeroing registers before each load.

Q4_K on Triton takes int8 activations by default (dp4a, llama.cpp's way): kernels_src/dequant_gemv_i8.py.
"""

from __future__ import annotations

import numpy as np

from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.paged_attention import empty

FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
QTYPES = tuple(FORMATS)  # qtype -> (elements, bytes) per block
ALIGN = {"Q4_K": 16}  # row alignment in bytes that the kernel's loads need (2 for the others)
SUBNORMAL_TARGETS = ("numpy", "triton", "triton-interpret")  # targets with IEEE subnormals at full speed


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


def _x_vals(xm, idx, n: int):
    """x[n * idx + k] for k < n as fp32 tiles; 16-bit x is read as one 32- (n = 2) or 64-bit (n = 4) word."""
    el = xm.dtype.elem
    if el.bits != 16:
        return [tl.load(xm + n * idx + k).to(tl.float32) for k in range(n)]
    word = tl.load(xm.to(tl.pointer_type(tl.uint32 if n == 2 else tl.uint64)) + idx)
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


# Each format has three steps: x_prep (x for one step, once), w_load (one row's raw tiles for the step) and w_dot
# (those tiles and the prepared x to a partial sum), so that the kernel can issue every load of a step first.

# --- Q4_0, Q4_1: 8 words of quants; word i holds elements 2i, 2i + 1 (low nibbles) and 16 + 2i, 17 + 2i ------------

def _q4_x(xm, b, dec, PARTS: int):
    xs, sums = [], []
    for i in _words(8, PARTS):
        lo, hi = _x_vals(xm, 16 * b + i, 2), _x_vals(xm, 16 * b + 8 + i, 2)
        xs.append([dec.x(lo[0], 0), dec.x(lo[1], 8), dec.x(hi[0], 4), dec.x(hi[1], 12)])
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


# --- Q4_K: super-blocks of d, dmin, 12 bytes of 6-bit scales and mins, 32 words of quants -------------------------
# Word j of chunk c (c < 4, j < 8) holds elements 64c + 4j + k in its low nibbles (sub-block 2c) and 64c + 32 + 4j + k
# in its high nibbles (sub-block 2c + 1), k < 4. Tiles are [STEP, 4 chunks, lanes per chunk, 4 words].
# Fields (word, shift) of elements k = 0..3, with up = word >> 12 bringing bytes 2 and 3 down:
_Q4K_LO = ((0, 0), (0, 8), (0, 16), (1, 12))
_Q4K_HI = ((0, 4), (0, 12), (1, 8), (1, 16))


def _chunks():
    return tl.arange(0, 4)[None, :, None, None]


def _q4k_x(xm, sb, dec, PARTS: int):
    lo, hi = [], []
    for j in _words(8, PARTS, 4):
        quad = 64 * sb + 16 * _chunks() + j
        lo.append(_x_vals(xm, quad, 4))
        hi.append(_x_vals(xm, quad + 8, 4))
    return ([[dec.x(v, s) for v, (_, s) in zip(x, _Q4K_LO, strict=True)] for x in lo],
            [[dec.x(v, s) for v, (_, s) in zip(x, _Q4K_HI, strict=True)] for x in hi], _add([_rsum(x) for x in lo]),
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


def _q4k_dot(raw, xp, dec):
    xlo, xhi, sum_lo, sum_hi = xp
    s_lo, s_hi = [], []
    for w, xl, xh in zip(raw[:-2], xlo, xhi, strict=True):
        words = (w, w >> 12)
        s_lo.append(_dot([dec.q(words[i], s, 4) for i, s in _Q4K_LO], xl))
        s_hi.append(_dot([dec.q(words[i], s, 4) for i, s in _Q4K_HI], xh))
    d, dmin, sc, mn = _q4k_scales(raw[-2], raw[-1])
    lo, hi = lambda t: (t & 0xFF).to(tl.float32), lambda t: (t >> 8).to(tl.float32)
    return ((d * dec.unit) * (lo(sc) * _add(s_lo) + hi(sc) * _add(s_hi))
            - dmin * (lo(mn) * sum_lo + hi(mn) * sum_hi))


# --- Q6_K: super-blocks of ql[128], qh[64], int8 scales[16], d -------------------------------------------------------
# In half h, element 128h + 32k + l (l < 32) is nibble k // 2 of ql[64h + 32(k % 2) + l] plus bits 2k, 2k + 1 of
# qh[32h + l] on top, minus 32, times scale 8h + 2k + l // 16. Word i of a half's 16 holds l = 2i, 2i + 1 of the
# three arrays. Tiles are [STEP, 2 halves, lanes per half, 4 words].

def _halves():
    return tl.arange(0, 2)[None, :, None, None]


def _q6k_x(xm, sb, dec, PARTS: int):
    out = []
    for i in _words(16, PARTS, 4):
        for k in range(4):
            v = _x_vals(xm, 128 * sb + 64 * _halves() + 16 * k + i, 2)
            out.append(([dec.x(v[0], 0), dec.x(v[1], 8)], _rsum(v)))
    return out


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
        shift = tl.min(i, axis=-1, keep_dims=True) // 8 * 8  # the lane's scales are those of l // 16 = i // 8
        for k in range(4):
            xs, xsum = xp[4 * p + k]
            sc = (scw[k] >> shift).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
            acc = acc + sc * (dec.unit * _dot([dec.q(six[k], 0, 6), dec.q(six[k], 8, 6)], xs) - 32.0 * xsum)
    return _f16(raw[-1]) * acc


# --- the kernel --------------------------------------------------------------------------------------------------

def _family(QTYPE: str, PARTS: int):
    """(tile rank, accumulator shape after STEP, x_prep, w_load, w_dot) of a format."""
    if QTYPE == "Q4_K":
        return 4, (4, 2 // PARTS, 1), _q4k_x, _q4k_load, _q4k_dot
    if QTYPE == "Q6_K":
        return 4, (2, 4 // PARTS, 1), _q6k_x, _q6k_load, lambda raw, xp, dec: _q6k_dot(raw, xp, dec, PARTS)
    if QTYPE == "Q8_0":
        return 3, (4 // PARTS, 1), _q8_x, _q8_load, _q8_dot
    return (3, (2 // PARTS, 1), _q4_x, lambda blk, mask, PARTS: _q4_load(blk, mask, QTYPE, PARTS),
            lambda raw, xp, dec: _q4_dot(raw, xp, dec, QTYPE))


def _gemv_body(w, y, n_rows, n_cols, w_stride, y_stride, elems, size, M, ROWS, STEP, PARTS, rank, acc_shape,
               x_prep, w_load, w_dot, PDL: bool = False):
    """The GEMV. Under PDL the caller's x_prep waits before loading x, after the step's weight loads; PDL waits once
    more before the stores, since a program whose loop runs no step must still wait (a later wait returns at once)."""
    n_blk = n_cols // elems
    rows = [tl.program_id(0) * ROWS + r for r in range(ROWS)]
    blocks = tl.arange(0, STEP)
    for _ in range(rank - 1):
        blocks = blocks[:, None]

    def body(it, *accs):
        b = it * STEP + blocks
        bmask = b < n_blk
        b = tl.minimum(b, n_blk - 1)  # past the end: re-read the last block, with its scales masked to 0
        raw = [w_load(w + tl.minimum(row, n_rows - 1).to(tl.int64) * w_stride + b * size, bmask & (row < n_rows),
                      PARTS) for row in rows]
        out = list(accs)
        for m in range(M):
            xp = x_prep(m, b)
            for r in range(ROWS):
                out[r * M + m] = out[r * M + m] + w_dot(raw[r], xp)
        return tuple(out)

    init = tuple(tl.zeros((STEP,) + acc_shape, tl.float32) for _ in range(ROWS * M))
    accs = tl.fori_loop(0, (n_blk + STEP - 1) // STEP, body, init)
    if PDL:
        tl.wait_prior_grid()
        tl.launch_dependents()
    for r, row in enumerate(rows):
        for m in range(M):
            tl.store(y + m * y_stride + row, tl.sum(accs[r * M + m]), mask=row < n_rows)


def dequant_gemv_kernel(w, x, y, n_rows, n_cols, w_stride, x_stride, y_stride, QTYPE: tl.constexpr, M: tl.constexpr,
                        ROWS: tl.constexpr, STEP: tl.constexpr, PARTS: tl.constexpr, SUBNORMAL: tl.constexpr,
                        PDL: tl.constexpr = False):
    """PDL: each step's weight loads are issued before waiting for x (as dequant_gemv_i8_kernel does): in the first
    step they overlap the kernel before; later waits return at once."""
    elems, size = FORMATS[QTYPE]
    rank, acc_shape, x_prep, w_load, w_dot = _family(QTYPE, PARTS)
    dec = _Decode(SUBNORMAL)

    def x_step(m, b):
        if PDL and m == 0:
            tl.wait_prior_grid()
        return x_prep(x + m * x_stride, b, dec, PARTS)

    _gemv_body(w, y, n_rows, n_cols, w_stride, y_stride, elems, size, M, ROWS, STEP, PARTS, rank, acc_shape, x_step,
               w_load, lambda raw, xp: w_dot(raw, xp, dec), PDL)


# --- host side -------------------------------------------------------------------------------------------------

# One-warp programs: more of them fit an SM, and one's loads fly while another computes (measured on an H200).
# Q4_K takes one part: 72 registers instead of 98 let 28 warps share an SM, so its 3584 programs at N = 14336 run as
# one wave (at two parts, 19 a SM: 1.4 waves, the last one a tail); 15.3 us against 16.5 on an H200.
LANES = {"Q4_K": 8, "Q6_K": 8, "Q8_0": 4, "Q4_0": 2, "Q4_1": 2}  # lanes on a block at PARTS = 1
BEST_PARTS = {"Q4_K": 1, "Q6_K": 1, "Q8_0": 2, "Q4_0": 2, "Q4_1": 2}


def default_tiles(qtype: str, m: int, n: int) -> dict:
    """ROWS, STEP, PARTS and num_warps: a warp's lanes cover STEP blocks, and a lane's words and x for every batch
    row stay in registers (fewer rows and parts as M grows)."""
    qtype = qtype.upper()
    parts = BEST_PARTS[qtype] if m <= 2 else 1
    rows = max(1, 4 // m) if n >= 1024 else 1
    return dict(ROWS=rows, STEP=max(1, 32 * parts // LANES[qtype]), PARTS=parts, num_warps=1)


def _addr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


def _aligned_rows(w, rb: int, align: int):
    """w, or a copy whose rows start `align`-byte aligned where w's do not (the kernel's wide loads need it)."""
    if _addr(w) % align == 0 and (elem_stride(w, 0) % align == 0 or w.shape[0] == 1):
        return w
    shape = (w.shape[0], -(-rb // align) * align)
    out = w.new_zeros(shape) if hasattr(w, "new_zeros") else np.zeros(shape, np.uint8)
    out[:, :rb] = w[:, :rb]
    return out


def dequant_gemv(x, w, qtype: str, *, out=None, rows: int | None = None, step: int | None = None,
                 parts: int | None = None, num_warps: int | None = None, target: str = "numpy",
                 int8_x: bool | None = None, pdl: bool | None = None):
    """y [M, N] = x [M, K] @ dequantize(w).T for raw GGUF blocks w (uint8 [N, row_bytes]); M <= 8; x may be 1-d.

    int8_x (default: dequant_gemv_i8.uses_int8): x quantized to int8 per 32 elements first, then integer dot
    products (kernels_src/dequant_gemv_i8.py); y then differs from the fp32 path by that quantization.
    pdl (default: dsl.use_pdl) applies to the fp32 path; the int8 path's GEMV is a PDL launch wherever use_pdl says."""
    qtype = qtype.upper()
    if qtype not in FORMATS:
        raise ValueError(f"unsupported qtype {qtype!r} (supported: {', '.join(QTYPES)})")
    from kernels_src.dequant_gemv_i8 import uses_int8  # the int8 path builds on this module's helpers
    int8_x = uses_int8(qtype, target, int8_x)
    vec = len(x.shape) == 1
    x2 = x[None] if vec else x
    m, k = x2.shape
    n = w.shape[0]
    rb = row_bytes(qtype, k) if k % FORMATS[qtype][0] == 0 else -1
    if m > 8 or rb <= 0 or w.shape[1] < rb or elem_stride(w, 1) != 1:
        raise ValueError(f"x [{m}, {k}] and {qtype} weights {tuple(w.shape)} do not make a GEMV of M <= 8")
    w = _aligned_rows(w, rb, ALIGN.get(qtype, 2))
    if elem_stride(x2, 1) != 1 or _addr(x2) % 8 or (m > 1 and elem_stride(x2, 0) % 4):  # x is read in 8-byte words
        x2 = x2.contiguous().clone() if hasattr(x2, "clone") else np.array(x2, order="C", copy=True)
    out = empty(x2, (m, n)) if out is None else out
    out2 = out[None] if len(out.shape) == 1 else out
    cfg = default_tiles(qtype, m, n)
    cfg.update({key: v for key, v in (("ROWS", rows), ("STEP", step), ("PARTS", parts), ("num_warps", num_warps))
                if v is not None})
    nw = cfg.pop("num_warps")
    grid = tl.cdiv(n, cfg["ROWS"])
    if int8_x:
        from kernels_src.dequant_gemv_i8 import gemv_i8
        gemv_i8(x2, w, out2, qtype, cfg["ROWS"], cfg["STEP"], nw, target)
        return out[0] if vec and len(out.shape) == 2 else out
    pdl = use_pdl(target, pdl)
    kern = compile(dequant_gemv_kernel, target, num_warps=nw, launch_pdl=pdl, QTYPE=qtype, M=m,
                   SUBNORMAL=target in SUBNORMAL_TARGETS, PDL=pdl, **cfg)
    kern[grid](w, x2, out2, n, k, elem_stride(w, 0), elem_stride(x2, 0), elem_stride(out2, 0))
    return out[0] if vec and len(out.shape) == 2 else out


def dequant_gemv_ref(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    """x @ W.T in fp32 with W decoded by our numpy dequantizer."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    return x @ dequantize(np.ascontiguousarray(w[:, :row_bytes(qtype, k)]), qtype, (w.shape[0], k)).T
