"""Dequantizing GEMV y[M, N] = x[M, K] @ W.T (M <= 8) straight from GGUF blocks: DSL kernel, launcher, reference.

W is the raw bytes [N, row_bytes] (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; layouts in ir/formats/gguf_quants.py). A row is cut
into chunks (a block, or a quarter super-block for the k-quants) of a few contiguous runs of 16 or 32 quant bytes.
One program takes BLOCK_R rows and walks K BLOCK_C chunks at a time: every byte is read once, in contiguous runs
along the row; scales are gathered once per chunk and broadcast along its lanes. Each lane keeps an fp32 partial
sum per batch row (the weights are decoded once and reused for every x row); the lanes are summed at the end.
"""

from __future__ import annotations

import numpy as np

from ir.formats.gguf_quants import dequantize, row_bytes
from kernels_src.dsl import compile, elem_stride, tl
from kernels_src.paged_attention import empty

# qtype -> (elements per chunk, lanes per chunk, chunks per block, block bytes)
FORMATS = {"Q4_0": (32, 16, 1, 18), "Q4_1": (32, 16, 1, 20), "Q8_0": (32, 32, 1, 34), "Q4_K": (64, 32, 4, 144),
           "Q6_K": (64, 16, 4, 210)}
QTYPES = tuple(FORMATS)


def _half(w16, byte_off, mask):
    """The fp16 field at even byte offsets, as fp32."""
    return tl.load(w16 + byte_off // 2, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


def _nibbles(qs):
    return (qs & 15).to(tl.float32), (qs >> 4).to(tl.float32)


def _legacy(w, w16, blk, ln, mask, ch, QTYPE):
    """Q4_0 / Q4_1 / Q8_0: one block per chunk; element e of the block is lane e (Q8_0) or nibble e // 16."""
    d = _half(w16, blk, mask)
    if QTYPE == "Q8_0":
        q = tl.load(w + blk + 2 + ln, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return [(d * q, ch * 32 + ln)]
    if QTYPE == "Q4_0":
        lo, hi = _nibbles(tl.load(w + blk + 2 + ln, mask=mask, other=0))
        return [(d * (lo - 8.0), ch * 32 + ln), (d * (hi - 8.0), ch * 32 + 16 + ln)]
    m = _half(w16, blk + 2, mask)
    lo, hi = _nibbles(tl.load(w + blk + 4 + ln, mask=mask, other=0))
    return [(d * lo + m, ch * 32 + ln), (d * hi + m, ch * 32 + 16 + ln)]


def _scale_min_k4(w, blk, j, mask):
    """Six-bit scale and min j (0..7) of a Q4_K super-block at byte blk (ggml's get_scale_min_k4)."""
    a = tl.load(w + blk + 4 + (j & 3), mask=mask, other=0)
    mb = tl.load(w + blk + 8 + (j & 3), mask=mask, other=0)
    c = tl.load(w + blk + 12 + (j & 3), mask=mask, other=0)
    low = j < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, mb & 63, (c >> 4) | ((mb >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


def _q4_k(w, w16, row, ch, ln, mask):
    """Chunk c of a super-block: qs bytes 32c.. hold sub-block 2c in low nibbles and 2c + 1 in high nibbles."""
    sb, c = ch // 4, ch % 4
    blk = row + sb * 144
    d, dmin = _half(w16, blk, mask), _half(w16, blk + 2, mask)
    lo, hi = _nibbles(tl.load(w + blk + 16 + c * 32 + ln, mask=mask, other=0))
    out = []
    for k, q in ((0, lo), (1, hi)):
        sc, mn = _scale_min_k4(w, blk, 2 * c + k, mask)
        out.append(((d * sc) * q - dmin * mn, sb * 256 + c * 64 + k * 32 + ln))
    return out


def _q6_k(w, w16, row, ch, ln, mask):
    """Chunk (h, f) of a super-block: elements 128h + 32k + 16f + lane, k = 0..3, each with its own scale."""
    sb, h, f = ch // 4, (ch // 2) % 2, ch % 2
    blk = row + sb * 210
    lane = 16 * f + ln
    a = tl.load(w + blk + 64 * h + lane, mask=mask, other=0)
    b = tl.load(w + blk + 64 * h + 32 + lane, mask=mask, other=0)
    qh = tl.load(w + blk + 128 + 32 * h + lane, mask=mask, other=0)
    d = _half(w16, blk + 208, mask)
    out = []
    for k, low in enumerate((a & 15, b & 15, a >> 4, b >> 4)):
        q = (low | (((qh >> (2 * k)) & 3) << 4)).to(tl.float32) - 32.0
        sc = tl.load(w + blk + 192 + 8 * h + 2 * k + f, mask=mask, other=0).to(tl.int8, bitcast=True)
        out.append(((d * sc.to(tl.float32)) * q, sb * 256 + 128 * h + 32 * k + 16 * f + ln))
    return out


def dequant_gemv_kernel(w, x, y, n_rows, n_cols, w_stride, x_stride, y_stride, QTYPE: tl.constexpr, M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    elems, lanes, per_block, type_size = FORMATS[QTYPE]
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    row = (rows.to(tl.int64) * w_stride)[:, None, None]
    ln = tl.arange(0, lanes)[None, None, :]
    w16 = w.to(tl.pointer_type(tl.uint16))
    n_chunks = n_cols // elems

    def body(it, *accs):
        ch = (it * BLOCK_C + tl.arange(0, BLOCK_C))[None, :, None]
        cmask = ch < n_chunks
        mask = rmask[:, None, None] & cmask
        if per_block == 1:
            parts = _legacy(w, w16, row + ch * type_size, ln, mask, ch, QTYPE)
        else:
            parts = (_q4_k if QTYPE == "Q4_K" else _q6_k)(w, w16, row, ch, ln, mask)
        out = []
        for m in tl.static_range(M):
            acc = accs[m]
            for vals, cols in parts:
                acc = acc + vals * tl.load(x + m * x_stride + cols, mask=cmask, other=0.0).to(tl.float32)
            out.append(acc)
        return tuple(out)

    init = tuple(tl.zeros([BLOCK_R, BLOCK_C, lanes], tl.float32) for _ in range(M))
    accs = tl.fori_loop(0, (n_chunks + BLOCK_C - 1) // BLOCK_C, body, init)
    for m in tl.static_range(M):
        tl.store(y + m * y_stride + rows, tl.sum(tl.sum(accs[m], axis=2), axis=1), mask=rmask)


# --- host side -------------------------------------------------------------------------------------------------

def default_tiles(qtype: str, m: int, n: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): 8 rows a program on tall matrices (4 on short ones, for enough programs), chunks for
    ~2 KiB of weights a step, and every accumulator within ~32 fp32 registers a thread at 4 warps."""
    lanes = FORMATS[qtype][1]
    block_r = 8 if n >= 8192 else 4
    block_c = max(1, 2048 // (block_r * lanes))
    while m * block_r * block_c * lanes > 4096 and block_c > 1:
        block_c //= 2
    return block_r, block_c


def dequant_gemv(x, w, qtype: str, *, out=None, block_r: int | None = None, block_c: int | None = None,
                 num_warps: int = 4, target: str = "numpy"):
    """y [M, N] = x [M, K] @ dequantize(w).T for raw GGUF blocks w (uint8 [N, row_bytes]); M <= 8; x may be 1-d."""
    qtype = qtype.upper()
    if qtype not in FORMATS:
        raise ValueError(f"unsupported qtype {qtype!r} (supported: {', '.join(QTYPES)})")
    vec = len(x.shape) == 1
    x2 = x[None] if vec else x
    m, k = x2.shape
    n = w.shape[0]
    if m > 8 or k % FORMATS[qtype][0] or w.shape[1] < row_bytes(qtype, k) or elem_stride(w, 1) != 1:
        raise ValueError(f"x [{m}, {k}] and {qtype} weights {tuple(w.shape)} do not make a GEMV of M <= 8")
    out = empty(x2, (m, n)) if out is None else out
    out2 = out[None] if len(out.shape) == 1 else out
    br, bc = default_tiles(qtype, m, n)
    kern = compile(dequant_gemv_kernel, target, num_warps=num_warps, QTYPE=qtype, M=m, BLOCK_R=block_r or br,
                   BLOCK_C=block_c or bc)
    kern[tl.cdiv(n, block_r or br)](w, x2, out2, n, k, elem_stride(w, 0), elem_stride(x2, 0), elem_stride(out2, 0))
    return out[0] if vec and len(out.shape) == 2 else out


def dequant_gemv_ref(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    """x @ W.T in fp32 with W decoded by our numpy dequantizer."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    return x @ dequantize(np.ascontiguousarray(w[:, :row_bytes(qtype, k)]), qtype, (w.shape[0], k)).T
