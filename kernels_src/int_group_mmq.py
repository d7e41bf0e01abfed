"""int_group_gemm's variant "mmq": y[M, N] = x @ W.T for intgroup W (4 and 8 bits) on int8 tensor cores, llama.cpp's
MMQ idea on ir/formats/int_groups.py's blocks ([scale f32][bias f32][q bytes], w = q * scale + bias, q unsigned).

- x pre-pass (quantize_x_mmq_kernel, one launch): int8 xq per step of S = min(G, 128) inputs (per-channel groups,
  G = K: S = 128), sx = max|x| / 127 of the step; at 4 bits each step's inputs stored as [even ones, odd ones], the
  order of a step's bytes' low nibbles and then their high ones. Beside it, per (step, row), xs [steps, 3, M padded
  to PAD_ROWS] (a step's rows contiguous: the GEMM loads them without clamps or 64-bit address math): D = sx / 16 (4
  bits) or sx (8 bits), P = sx * C * sum(xq over the odd half at 4 bits (C = 8), all of it at 8 (C = 128)) and Q =
  sx * sum(xq).
- A step takes the W rows' [BLOCK_N, S * b / 8] q bytes. 4 bits: `v & 15` (q of the even inputs) and `(v & 0xF0) ^
  0x80` (16 q - 128 of the odd ones; byte-wise AND / XOR, done 4 bytes a LOP3: no byte shift, which the compiler
  unpacks byte by byte) are int8 operands against x's halves: A = dot(lo, x_even) (from 0), T = dot(hi, x_odd, 16 A
  + BASE) = BASE + 16 sum(q xq) - 128 sum_odd(xq). 8 bits: T = dot(v ^ 0x80, xq, BASE) = BASE + sum(q xq) - 128
  sum(xq). |T - BASE| <= 64 * 15 * 127 * 16 + 64 * 128 * 127 = 2,991,104 (4 bits, S = 128), 128 * 128 * 127 =
  2,080,768 (8 bits): below 2**22, so with BASE = 0x4B400000 (the bits of 1.5 * 2**23) T's bits read as the float
  1.5 * 2**23 + (T - BASE) exactly, and one FADD gives it in fp32 without I2F (int_group_gemv_i8's _DP4A_BASE).
- Hence sum_k w_k x_k over the step ~ sx * (scale sum(q xq) + bias sum(xq)) = scale (D T + P) + bias Q: a LEA (16 A
  + BASE), an FADD, three FFMAs an output a step outside the MMAs (sm_90 SASS of a 128-input step, 64 x 128 tiles,
  8 warps: 304 instructions, 4 IGMMA, 128 registers; docs/ARCHITECTURE.md compares it with variant stream).
- Each dot's MMAs are waited for where Triton emits them (sm_90: WARPGROUP.ARRIVE, 2 IGMMA, WARPGROUP.DEPBAR a dot;
  the epilogue reads T each step, so no MMA runs past its step). Tried 2026-12-05: the odd half's dot from zero,
  summed after (a subtraction, since Triton folds dot + add back into the chained dot), keeps the same two waits a
  step and takes 168 registers against 128.
- SWAP orientation (W the MMA's M side, 64 rows a warpgroup; the batch its N); rows past M and N clamped, not
  masked; split-K through dequant_gemm's partials and reduce.
Accuracy: x moves by at most sx / 2 an input, so |y - x @ W.T| <= sum_k |W[n, k]| sx_k / 2 (mmq_error_bound), plus
fp32 rounding; on random data 0.6-0.8% of max |y| (gguf_mmq's x is per 32 inputs; here per S, the weights' group).
"""

from __future__ import annotations

import numpy as np

from ir.formats import int_groups
from kernels_src.dequant_gemm import _pow2_divisor
from kernels_src.dequant_gemv_i8 import _MAGIC
from kernels_src.dsl import compile, elem_stride, empty, tl
from kernels_src.gguf_mmq import loop_stages
from kernels_src.split_k import store_tile

__all__ = ["mmq_error_bound", "mmq_fits", "mmq_ref", "mmq_step", "prefetch_for", "quantize_x_mmq",
           "quantize_x_mmq_ref"]

MAX_STEP = 128  # inputs a step (a whole group of 128: 64 q bytes a row at 4 bits)
BASE = 0x4B400000  # the bits of 1.5 * 2**23 (_MAGIC): an int32 accumulator started here reads as _MAGIC + its sum
# outputs a thread up to which the epilogue's loads run a step ahead (sm_90 builds: 16 x 64 tiles, 4 warps, 8 outputs
# a thread: 70 registers; 64 x 128, 8 warps, 32 outputs: 178 registers against 128 without, which keeps 2 programs
# an SM, whose loads then wait in turn)
PREFETCH_OUTPUTS = 16
PAD_ROWS = 128  # xs's rows (x's) padded to a multiple of the largest BLOCK_M: the GEMM loads them unclamped
PRE_STEPS = 8  # steps a pre-pass program quantizes (the largest power of two dividing the row's steps, up to this)
MIN_HALF = 32  # the int8 MMA's least depth: each 4-bit nibble half and each 8-bit step at least this deep


def _halves(BITS: int) -> int:
    """Parts a step of x is stored in: [even, odd] inputs at 4 bits (a byte's low and high nibble), one at 8."""
    return 2 if BITS == 4 else 1


def quantize_x_mmq_kernel(x, xq, xs, x_stride, xq_stride, xs_stride, xs_plane, BITS: tl.constexpr,
                          STEP: tl.constexpr, STEPS: tl.constexpr = 1):
    """Program (steps, row): STEPS steps of x's row to int8 xq (STEP inputs a step, at 4 bits permuted [even, odd])
    and their D, P, Q in xs."""
    tl.launch_dependents()  # the GEMM after this may start: it waits for xq before its first load of it
    H = _halves(BITS)
    m = tl.program_id(1)
    s = tl.program_id(0) * STEPS + tl.arange(0, STEPS)[:, None, None]  # [STEPS, 1, 1]
    part, j = tl.arange(0, H)[None, :, None], tl.arange(0, STEP // H)[None, None, :]  # input H j + part of a step
    v = tl.load(x + m * x_stride + s * STEP + H * j + part).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), axis=2, keep_dims=True), axis=1, keep_dims=True)  # [STEPS, 1, 1]
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = (v * inv + _MAGIC).to(tl.int32, bitcast=True) - BASE  # round to nearest even, exact in int32
    tl.store(xq + m * xq_stride + s * STEP + part * (STEP // H) + j, q.to(tl.int8))
    sx = amax * (1.0 / 127.0)
    total = tl.sum(tl.sum(q, axis=2, keep_dims=True), axis=1, keep_dims=True).to(tl.float32)
    if BITS == 4:  # 16 q - 128 for the odd inputs: 8 sum_odd(xq) a scale, and D = sx / 16
        odd = tl.sum(tl.sum(tl.where(part == 1, q, 0), axis=2, keep_dims=True), axis=1, keep_dims=True)
        d, p = sx * 0.0625, sx * (8.0 * odd.to(tl.float32))
    else:  # q - 128 for all: 128 sum(xq)
        d, p = sx, sx * (128.0 * total)
    at = xs + s * xs_stride + m
    tl.store(at, d)
    tl.store(at + xs_plane, p)
    tl.store(at + 2 * xs_plane, sx * total)


def int_group_mmq_kernel(w, xq, xs, y, m_rows, n_rows, w_stride, xq_stride, xs_stride, xs_plane, y_stride,
                         split_stride, n_steps, steps_per_split, BITS: tl.constexpr, GROUP: tl.constexpr,
                         STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 0):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. (STEP inputs each); w
    int32 words [N, row_words]; xq, xs from quantize_x_mmq; y the output (split_stride 0) or fp32 partials.
    PREFETCH: the epilogue's scales, biases and D, P, Q (plain loads: Triton's pipeliner stages only what feeds a
    dot) loaded a step ahead, carried in registers. LOOP_STAGES (0: none): the K loop software-pipelined by Triton,
    W's q bytes by cp.async ahead too (gguf_mmq.LOOP_STAGES, LLM_ENGINE_MMQ_LOOP_STAGES)."""
    H = _halves(BITS)
    HALF = STEP // H  # x's inputs a dot; W's q bytes a row a step: STEP * BITS / 8 = HALF
    BW = 2 + GROUP * BITS // 32  # words a group block: scale, bias, q words
    SPG = GROUP // STEP  # steps a group
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = w + tl.minimum(n, n_rows - 1).to(tl.int64) * w_stride  # [BLOCK_N]; past N the last row, not stored
    mc = tl.minimum(m, m_rows - 1).to(tl.int64)  # past M the last row, not stored
    xcol = xq + mc[None, :] * xq_stride + tl.arange(0, HALF)[:, None]  # K-major [HALF, BLOCK_M]
    xsm = xs + m  # unclamped: xs's rows are padded to a multiple of PAD_ROWS, so a step's are contiguous
    e = tl.arange(0, HALF)[None, :]
    lo = tl.program_id(2) * steps_per_split
    if PDL:  # xq is the pre-pass's output
        tl.wait_prior_grid()
        tl.launch_dependents()

    def epilogue_args(it):
        """Step it's scales and biases [BLOCK_N, 1] (its group's block header) and x's D, P, Q [1, BLOCK_M]."""
        blk = wrow + (it // SPG) * BW
        at = xsm + it * xs_stride
        return (tl.load(blk).to(tl.float32, bitcast=True)[:, None],
                tl.load(blk + 1).to(tl.float32, bitcast=True)[:, None],
                tl.load(at)[None, :], tl.load(at + xs_plane)[None, :], tl.load(at + 2 * xs_plane)[None, :])

    def step(it, acc, *ahead):
        # the step's q bytes (HALF a row: a multiple of 32, known to the compiler as such, so they load as vectors)
        qb = (wrow + (it // SPG) * BW + 2).to(tl.pointer_type(tl.uint8))[:, None] + e
        if SPG > 1:  # a slice of a longer group (per-channel)
            qb = qb + (it % SPG) * HALF
        v = tl.load(qb)  # [BLOCK_N, HALF] bytes
        x0 = tl.load(xcol + it * STEP)
        if BITS == 4:
            a = tl.dot((v & 15).to(tl.int8, bitcast=True), x0)
            hi = ((v & 0xF0) ^ 0x80).to(tl.int8, bitcast=True)  # 16 q - 128
            t = tl.dot(hi, tl.load(xcol + it * STEP + HALF), a * 16 + BASE)
        else:
            t = tl.dot((v ^ 0x80).to(tl.int8, bitcast=True), x0, tl.full((BLOCK_N, BLOCK_M), BASE, tl.int32))
        tf = t.to(tl.float32, bitcast=True) - _MAGIC  # exact: |t - BASE| < 2**22
        scale, bias, d, p, qs = ahead if PREFETCH else epilogue_args(it)
        acc = acc + scale * (tf * d + p)
        acc = acc + bias * qs
        return (acc, *epilogue_args(tl.minimum(it + 1, n_steps - 1))) if PREFETCH else acc

    hi = tl.minimum(lo + steps_per_split, n_steps)
    if PREFETCH:
        acc = tl.fori_loop(lo, hi, step, (tl.zeros((BLOCK_N, BLOCK_M), tl.float32), *epilogue_args(lo)),
                           stages=LOOP_STAGES)[0]
    else:
        acc = tl.fori_loop(lo, hi, step, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), stages=LOOP_STAGES)
    store_tile(acc, y, m, n, m_rows, n_rows, y_stride, split_stride, True)


# --- host side -------------------------------------------------------------------------------------------------

def mmq_step(bits: int, group: int, k: int) -> int | None:
    """S, the inputs of a step, where this kernel takes the problem: min(group, MAX_STEP), a power of two dividing
    the group and the row, each dot at least MIN_HALF deep (4 bits: S >= 64; 8 bits: S >= 32); else None."""
    s = min(group, MAX_STEP)
    if bits not in (4, 8) or s & (s - 1) or s // _halves(bits) < MIN_HALF or group % s or k % s:
        return None
    return s


def mmq_fits(bits: int, group: int, k: int) -> bool:
    return mmq_step(bits, group, k) is not None


def prefetch_for(block_m: int, block_n: int, num_warps: int) -> bool:
    """PREFETCH where a thread holds up to PREFETCH_OUTPUTS outputs."""
    return block_m * block_n <= PREFETCH_OUTPUTS * 32 * num_warps


def quantize_x_mmq(x2, bits: int, step: int, target: str = "numpy"):
    """(xq int8 [M, K], xs fp32 [K / step, 3, M padded to PAD_ROWS]: D, P, Q; rows past M unwritten) of x2 [M, K]
    (rows contiguous), one launch."""
    m, k = x2.shape
    xq, xs = empty(x2, (m, k), "int8"), empty(x2, (k // step, 3, -(-m // PAD_ROWS) * PAD_ROWS), "float32")
    steps = k // step
    per = _pow2_divisor(steps, PRE_STEPS)
    kern = compile(quantize_x_mmq_kernel, target, num_warps=max(1, per * step // 256), BITS=bits, STEP=step,
                   STEPS=per)
    kern[steps // per, m](x2, xq, xs, elem_stride(x2, 0), elem_stride(xq, 0), elem_stride(xs, 0), elem_stride(xs, 1))
    return xq, xs


def launch_mmq(x2, w, bits: int, group: int, out, cfg: dict, nw: int, ns: int | None, split: int, target: str,
               pdl: bool, x_mmq: tuple | None = None):
    """The pre-pass (or x_mmq, its (xq, xs) made with x: kernels_src/x_int8_groups), then int_group_mmq_kernel at
    cfg's BLOCK_M / BLOCK_N (and PREFETCH: by default where a thread holds up to PREFETCH_OUTPUTS outputs; LOOP_STAGES:
    by default gguf_mmq.LOOP_STAGES) through split_k.launch_split_k; w as int32 words, checked by the caller."""
    from kernels_src.split_k import launch_split_k

    m, k = x2.shape
    step = mmq_step(bits, group, k)
    if step is None:
        raise ValueError(f"mmq takes {bits}-bit groups of {group} in rows of {k} only where a step of "
                         f"min(group, {MAX_STEP}) inputs is a power of two dividing the group and the row, each dot "
                         f">= {MIN_HALF} deep (4 bits: groups of 64 or more; 8 bits: 32 or more)")
    if x_mmq is None:
        xq, xs = quantize_x_mmq(x2, bits, step, target)
    else:
        xq, xs = x_mmq
        rows = xs.shape[2]
        if tuple(xq.shape) != (m, k) or tuple(xs.shape[:2]) != (k // step, 3) or rows < m or rows % PAD_ROWS:
            raise ValueError(f"mmq: x's given int8 form {tuple(xq.shape)}, {tuple(xs.shape)} is not quantize_x_mmq's "
                             f"of [{m}, {k}] in steps of {step}")
    prefetch = cfg.get("PREFETCH")
    if prefetch is None:
        prefetch = prefetch_for(cfg["BLOCK_M"], cfg["BLOCK_N"], nw)
    kern = compile(int_group_mmq_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl, BITS=bits,
                   GROUP=group, STEP=step, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], PREFETCH=bool(prefetch),
                   PDL=pdl, LOOP_STAGES=loop_stages(cfg.get("LOOP_STAGES")))
    args = (m, w.shape[0], elem_stride(w, 0), elem_stride(xq, 0), elem_stride(xs, 0), elem_stride(xs, 1))
    return launch_split_k(kern, (w, xq, xs), args, out, k // step, split, cfg["BLOCK_M"], cfg["BLOCK_N"], target,
                          pdl)


def quantize_x_mmq_ref(x: np.ndarray, bits: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize_x_mmq in numpy, bit for bit (fp32 arithmetic): (xq [M, K], xs [K / step, 3, M], unpadded)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    b = x.reshape(m, k // step, step)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int32)
    sx = (amax[..., 0] * np.float32(1 / 127)).astype(np.float32)
    total = q.sum(-1).astype(np.float32)
    if bits == 4:
        d, p = sx * np.float32(0.0625), sx * (np.float32(8) * q[..., 1::2].sum(-1).astype(np.float32))
        q = np.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    else:
        d, p = sx, sx * (np.float32(128) * total)
    return q.astype(np.int8).reshape(m, k), np.stack([d, p, sx * total]).transpose(2, 0, 1).astype(np.float32)


def mmq_ref(xq: np.ndarray, xs: np.ndarray, w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """The kernel's arithmetic in numpy on the pre-pass's output: T exact in integers (the nibble operands as the
    kernel forms them), then sum over steps of scale (D T + P) + bias Q in float64: y [M, N]."""
    m, k = xq.shape
    step = k // xs.shape[0]
    n = w.shape[0]
    qbytes, scales, biases = int_groups.split(np.ascontiguousarray(w).view(np.uint8), bits, group, n, k)
    steps = k // step
    qb = qbytes.reshape(n, steps, step * bits // 8).astype(np.int64)
    xqs = xq.reshape(m, steps, step).astype(np.int64)
    if bits == 4:
        lo, hi = qb & 15, ((qb & 0xF0) ^ 0x80).astype(np.uint8).view(np.int8).astype(np.int64)
        half = step // 2
        t = 16 * np.einsum("nsj,msj->nms", lo, xqs[..., :half]) + np.einsum("nsj,msj->nms", hi, xqs[..., half:])
    else:
        t = np.einsum("nsj,msj->nms", (qb ^ 0x80).astype(np.uint8).view(np.int8).astype(np.int64), xqs)
    g = np.arange(steps) * step // group  # each step's group
    sc, bi = scales[:, g].astype(np.float64)[:, None], biases[:, g].astype(np.float64)[:, None]  # [N, 1, steps]
    d, p, qs = (a.T[:m].astype(np.float64)[None] for a in xs.transpose(1, 0, 2))  # [1, M, steps] each
    return (sc * (t * d + p) + bi * qs).sum(-1).T


def mmq_error_bound(x: np.ndarray, w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """|y_mmq - x @ W.T| per output [M, N] from x's quantization: each input moves by at most half its step's sx,
    so |dy| <= sum_k |W[n, k]| sx_k / 2 (fp32 rounding aside)."""
    x = np.asarray(x, np.float64)
    m, k = x.shape
    step = mmq_step(bits, group, k)
    wd = int_groups.dequantize(np.ascontiguousarray(w).view(np.uint8), (w.shape[0], k), bits, group)
    sx = np.repeat(np.abs(x).reshape(m, -1, step).max(-1) / 127, step, axis=-1)
    return 0.5 * sx @ np.abs(wd.astype(np.float64)).T
