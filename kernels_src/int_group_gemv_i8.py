"""The integer-group GEMV on int8 activations (dp4a, as llama.cpp's mmvq and dequant_gemv_i8.py for Q4_K), built on
int_group_gemv.py's walk of a row (vectors one a lane, each vector's q words in one block).

quantize_x_i8_kernel turns x into int8 per chunk of the inputs of one q word (8 at 4 bits, 4 at 8 bits): q = round(x
* 127 / max|x|), d = max|x| / 127, the exact sum of the chunk's x (what the block's bias meets) and z0 times what
quantizing took from it, z0 sum(x - q d) (z0 = 2**(bits - 1), the middle code), which the scale meets: y's error is
then sum_k scale (q_k - z0)(x_k - xq_k), about half of what q_k alone would leave. At 4 bits a chunk's q are two
32-bit words (planes): plane 0 holds inputs 0, 2, 4, 6 and plane 1 inputs 1, 3, 5, 7, where w & 0x0F0F0F0F and
(w >> 4) & 0x0F0F0F0F leave the q word's nibbles; at 8 bits one word in input order. Every array sits at the places
of the q words in a row of blocks (headers' places hold 0: they add nothing), so the GEMV reads x like W, one
16-byte vector a lane and array, without masks but past the row's end.

A q word then costs 3 integer ops (masks, a shift) and 2 dp4a (1 at 8 bits) instead of 2 ops a weight: the dp4a
chain starts at 0x4B400000, so its bits are the float 1.5 * 2**23 + sum(q x) (|sum| < 2**22), read by one FADD;
d multiplies once a word, scale and bias once a lane, row and step. sm_90 SASS of the loop step at 4 bits, groups of
128, one row of x and 4 rows of W (2 KiB of W): 201 instructions against 494 for the fp32-x kernel (Q4_K's fp32
GEMV: 572 for 2 KiB); 9 16-byte loads. y moves by x's quantization alone: |dy| <= sum_k |scale (q_k - z0)| d_k / 2
(int8_error_bound); on random data about 0.1-0.5% of max |y|.
"""

from __future__ import annotations

import numpy as np

from ir.formats import int_groups
from kernels_src.dequant_gemv_i8 import _MAGIC, _absmax, _quantize
from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl
from kernels_src.gemv_loop import k_loop
from kernels_src.gguf_gemv_common import _add
from kernels_src.int_group_gemv import _program_rows, _scale_bias, _store_rows, _words

_DP4A_BASE = 0x4B400000  # the bits of 1.5 * 2**23 (_MAGIC): a dp4a chain started here reads as _MAGIC + its sum


def _planes(BITS: int) -> int:
    return 2 if BITS == 4 else 1


def quantize_x_i8_kernel(x, xq, xd, xs, xr, n_groups, x_stride, xq_stride, xd_stride, BITS: tl.constexpr,
                         GROUP: tl.constexpr, CHUNKS: tl.constexpr):
    """x [M, K] to int8 words, d, sums of x and z0 sum(x - q d), each at the place of its q word in a row of blocks
    (row words RW = n_groups * block words; the planes' words at p * RW + place; headers' places hold 0), so the
    GEMV reads them like W (grid: cdiv(K / chunk, CHUNKS), M)."""
    tl.launch_dependents()  # the GEMV after this may start now: it loads weights until it needs x
    m = tl.program_id(1)
    _quantize_chunks(x + m * x_stride, xq.to(tl.pointer_type(tl.uint32)) + m * (xq_stride // 4), xd + m * xd_stride,
                     xs + m * xd_stride, xr + m * xd_stride, tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS),
                     n_groups, BITS, GROUP)


def _quantize_chunks(xm, words, xd, xs, xr, c, n_groups, BITS: int, GROUP: int):
    """quantize_x_i8_kernel's work on chunks c (a 1-d tile; those past the row's end skipped) of one row: xm the
    row of x, words its uint32 xq row, xd, xs, xr its rows of those arrays (x_int8_groups runs it on a norm's or
    activation's output, so the arrays are these, bit for bit)."""
    QW, _, BW = _words(BITS, GROUP)
    EPW, RW = 32 // BITS, n_groups * BW  # inputs a chunk (a q word's), words a row
    ok = c < n_groups * QW
    c = tl.minimum(c, n_groups * QW - 1)
    g = c // QW
    place = c + 2 * g + 2  # g * BW + 2 + (c - g * QW)
    xm = xm + c * EPW
    # byte k of plane p: input 2k + p (4 bits: the nibble order of the masked words), k (8 bits)
    vals = [[tl.load(xm + (2 * k + p if BITS == 4 else k)).to(tl.float32) for k in range(4)]
            for p in range(_planes(BITS))]
    flat = [v for plane in vals for v in plane]
    amax = _absmax(flat, ())
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    first = ok & (c == g * QW)  # a block's first chunk writes its header's zeros
    for p, plane in enumerate(vals):
        word, d = _quantize(plane, amax)
        tl.store(words + p * RW + place, word, mask=ok)
        for h in (1, 2):
            tl.store(words + p * RW + place - h, 0, mask=first)
    rest = _add([v - ((v * inv + _MAGIC) - _MAGIC) * d for v in flat])  # what the q d of _quantize left
    for arr, val in ((xd, d), (xs, _add(flat)), (xr, rest * float(1 << (BITS - 1)))):
        tl.store(arr + place, val, mask=ok)
        for h in (1, 2):
            tl.store(arr + place - h, 0.0, mask=first)


def int_group_gemv_i8_kernel(w, xq, xd, xs, xr, y, n_rows, n_groups, w_stride, xq_stride, xd_stride, y_stride,
                             BITS: tl.constexpr, GROUP: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
                             LANES: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False,
                             PREFETCH: tl.constexpr = False, STAGES: tl.constexpr = 0):
    """int_group_gemv_kernel on quantize_x_i8_kernel's output (xq_stride in bytes, xd_stride for xd, xs and xr).
    PDL: launched as a programmatic dependent launch; each step's weight loads come before the wait for x.
    PREFETCH, STAGES: gemv_loop.k_loop's (a step's raw tiles: every row's q words and header words)."""
    BW = _words(BITS, GROUP)[2]
    RW = n_groups * BW
    rows, w32, w64 = _program_rows(w, w_stride, n_rows, ROWS)
    lane, slot = tl.arange(0, LANES)[:, None], tl.arange(0, VEC)[None, :]
    n_vec = RW // VEC

    def vectors(it):
        v = it * LANES + lane
        s0 = tl.minimum(v, n_vec - 1) * VEC  # past the row's end: the last vector's W again, its x read as 0
        return v < n_vec, s0, s0 // BW  # g: the block of the vector's q words (see int_group_gemv.py)

    def load(it):
        _, s0, g = vectors(it)
        return ([tl.load(p + s0 + slot).to(tl.uint32, bitcast=True) for p in w32]
                + [tl.load(p + g * (BW // 2)) for p in w64])

    def compute(it, raw, accs):
        live, s0, _ = vectors(it)
        heads = [_scale_bias(h) for h in raw[ROWS:]]
        if PDL and not STAGES:
            tl.wait_prior_grid()
        out = list(accs)
        for m in range(M):
            at = m * xd_stride + s0 + slot
            xw = xq.to(tl.pointer_type(tl.uint32)) + m * (xq_stride // 4) + s0 + slot
            planes = [tl.load(xw + p * RW, mask=live, other=0) for p in range(_planes(BITS))]
            d = tl.load(xd + at, mask=live, other=0.0)
            xsum = tl.sum(tl.load(xs + at, mask=live, other=0.0), axis=-1, keep_dims=True)
            rest = tl.sum(tl.load(xr + at, mask=live, other=0.0), axis=-1, keep_dims=True)
            for r, (scale, bias) in enumerate(heads):
                if BITS == 4:
                    isum = tl.dot4(raw[r] & 0x0F0F0F0F, planes[0], _DP4A_BASE)
                    isum = tl.dot4((raw[r] >> 4) & 0x0F0F0F0F, planes[1], isum)
                else:
                    isum = tl.dot4(raw[r], planes[0], _DP4A_BASE)
                qx = tl.sum(d * (isum.to(tl.float32, bitcast=True) - _MAGIC), axis=-1, keep_dims=True) + rest
                out[r * M + m] = out[r * M + m] + scale * qx + bias * xsum
        return out

    if PDL and STAGES:  # the pipeliner would hoist the first steps' x loads above a wait inside the loop
        tl.wait_prior_grid()
    init = tuple(tl.zeros((LANES, 1), tl.float32) for _ in range(ROWS * M))
    accs = k_loop((n_vec + LANES - 1) // LANES, load, compute, init, PREFETCH, STAGES)
    _store_rows(y, y_stride, rows, n_rows, accs, M, 1.0, PDL)


# --- host side -------------------------------------------------------------------------------------------------

I8_TARGETS = ("triton",)  # targets that take the int8 path by default (dp4a; the others keep fp32 x)


def uses_int8(target: str, int8_x: bool | None = None) -> bool:
    """Whether int_group_gemv takes the int8-activation path (int8_x None: the target's default)."""
    return target in I8_TARGETS if int8_x is None else bool(int8_x)


def quantize_x_i8(x, bits: int, group: int, target: str = "numpy"):
    """(int8 words as bytes [M, planes * RW * 4], then d, sums and z0 sum(x - q d), each f32 [M, RW]) of x [M, K] by
    chunks of one q word's inputs (8 at 4 bits, 4 at 8), each at its q word's place in a row of blocks of
    RW = K / group * block words (headers' places 0)."""
    m, k = x.shape
    rw = k // group * _words(bits, group)[2]
    xq = empty(x, (m, _planes(bits) * rw * 4), "int8")
    xd, xs, xr = (empty(x, (m, rw), "float32") for _ in range(3))
    chunks = 32
    compile(quantize_x_i8_kernel, target, num_warps=1, BITS=bits, GROUP=group, CHUNKS=chunks)[
        tl.cdiv(k * bits // 32, chunks), m](x, xq, xd, xs, xr, k // group, elem_stride(x, 0), elem_stride(xq, 0),
                                             elem_stride(xd, 0))
    return xq, xd, xs, xr


def gemv_i8(x, w, out, bits: int, group: int, vec: int, cfg: dict, num_warps: int, target: str,
            pdl: bool | None = None, prefetch: bool = False, stages: int = 0, x_i8: tuple | None = None) -> None:
    """int_group_gemv's int8 path: quantize_x_i8, then the dp4a GEMV (a PDL launch as use_pdl(target, pdl) says;
    prefetch, stages: its loop's form, gemv_loop.k_loop); x_i8: quantize_x_i8's arrays of x already made
    (kernels_src/x_int8_groups' fused norm / activation wrote them), so no quantize_x_i8 launch."""
    m, k = x.shape
    xq, xd, xs, xr = quantize_x_i8(x, bits, group, target) if x_i8 is None else x_i8
    pdl = use_pdl(target, pdl)
    kern = compile(int_group_gemv_i8_kernel, target, num_warps=num_warps, launch_pdl=pdl, BITS=bits, GROUP=group,
                   M=m, VEC=vec, PDL=pdl, PREFETCH=prefetch, STAGES=stages, **cfg)
    kern[(tl.cdiv(w.shape[0], cfg["ROWS"]),)](w, xq, xd, xs, xr, out, w.shape[0], k // group, elem_stride(w, 0),
                                              elem_stride(xq, 0), elem_stride(xd, 0), elem_stride(out, 0))


def unplace(a: np.ndarray, bits: int, group: int, k: int) -> np.ndarray:
    """quantize_x_i8's arrays at their q words' places [M, planes * RW (* 4 bytes)] back to [M, planes, chunks(, 4)],
    checking that the headers' places hold 0."""
    qw, _, bw = _words(bits, group)
    m, ng = a.shape[0], k // group
    b = np.asarray(a).reshape(m, -1, ng, bw, *((4,) if a.dtype == np.int8 else ()))
    assert not b[:, :, :, :2].any(), "quantize_x_i8 left a header's place nonzero"
    return b[:, :, :, 2:].reshape(m, b.shape[1], ng * qw, *b.shape[4:])


def quantize_x_i8_ref(x: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """quantize_x_i8 in numpy, inputs in their own order: (int8 q [M, K], then d, sums and z0 sum(x - q d)
    [M, K / chunk])."""
    x = np.asarray(x, np.float32)
    ch = x.reshape(x.shape[0], -1, 32 // bits)
    amax = np.abs(ch).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(ch * inv).astype(np.int8)
    d = (amax * np.float32(1 / 127)).astype(np.float32)
    rest = (ch - q * d).sum(-1, dtype=np.float32) * np.float32(1 << (bits - 1))
    return q.reshape(x.shape), d[..., 0], ch.sum(-1, dtype=np.float32), rest


def unplane(xq: np.ndarray, bits: int, group: int, k: int) -> np.ndarray:
    """quantize_x_i8's words back to int8 q [M, K] in input order."""
    b = unplace(np.ascontiguousarray(xq).view(np.int8), bits, group, k)  # [M, planes, chunks, 4]
    if bits == 8:
        return b.reshape(b.shape[0], -1)
    return np.stack([b[:, 0], b[:, 1]], axis=-1).reshape(b.shape[0], -1)  # (k, plane) -> input 2k + plane


def _blocks(w: np.ndarray, bits: int, group: int, k: int):
    """(q [N, K / group, group] f64, scales and biases [N, K / group]) of blocks w."""
    n = w.shape[0]
    qbytes, scales, biases = int_groups.split(np.ascontiguousarray(w).view(np.uint8), bits, group, n, k)
    return int_groups.unpack_q(qbytes, bits).astype(np.float64).reshape(n, -1, group), scales, biases


def gemv_i8_ref(q: np.ndarray, d: np.ndarray, sums: np.ndarray, rest: np.ndarray, w: np.ndarray, bits: int,
                group: int) -> np.ndarray:
    """What the int8 GEMV computes, in fp64: scale (sum(q_w (q d)) + rest) + bias sums, a block at a time."""
    m, k = q.shape
    qw, scales, biases = _blocks(w, bits, group, k)
    xd = (q.astype(np.float64).reshape(m, -1, 32 // bits) * d[..., None]).reshape(m, -1, group)
    per = group * bits // 32  # chunks a group
    dots = np.einsum("ngj,mgj->mng", qw, xd) + rest.reshape(m, -1, per).sum(-1)[:, None]
    bias = np.einsum("ng,mg->mn", biases.astype(np.float64), sums.reshape(m, -1, per).sum(-1))
    return (dots * scales[None]).sum(-1) + bias


def int8_error_bound(x: np.ndarray, w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """|y_int8 - y| per output [M, N] from quantizing x alone: each x moves by at most d / 2 (its chunk's step) and
    meets scale (q - z0), so |dy| <= sum_k |scale (q_k - z0)| d_k / 2 (fp32 rounding aside)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    qw, scales, _ = _blocks(w, bits, group, k)
    sq = np.abs((qw - (1 << (bits - 1))) * scales[..., None]).reshape(w.shape[0], k)
    step = np.repeat(np.abs(x).reshape(m, -1, 32 // bits).max(-1) / 127, 32 // bits, axis=-1)
    return 0.5 * step.astype(np.float64) @ sq.T
