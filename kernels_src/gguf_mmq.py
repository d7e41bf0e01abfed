"""Quantized GEMM on int8 tensor cores (llama.cpp's MMQ), y[M, N] = x[M, K] @ dequantize(W).T for Q4_K and Q6_K
(the runner's choice at 4..32 rows): DSL kernels, launcher, reference.

dequant_gemm.py turns every quant into a float, scaled, before an fp16 MMA: per element a mask, an OR, a subtract,
a multiply and a conversion, which makes it 5x slower than the GEMV on the same bytes (its per-element work, not the
MMA, is the cost). Here the quants stay integers:
- x is quantized to int8 per 32 elements (dequant_gemv_i8.quantize_x: q, d = max|x| / 127), the size of a Q4_K
  sub-block.
- A program owns W rows BLOCK_N.. x rows BLOCK_M.. and walks K one super-block (256 elements, 8 sub-blocks) a
  step. Chunk c's 32 bytes hold sub-block 2c in their low nibbles and 2c + 1 in their high ones, so a nibble tile
  [BLOCK_N, 32] is one AND (or shift) of the loaded bytes, already an int8 operand: one int8 MMA of K = 32 against
  x's matching int8 tile gives sum_e q_e xq_e exactly, per (row, x row).
- Sub-block j's value is d sc_j q - dmin mn_j, so its dot is d sc_j dx_j sum(q xq) - dmin mn_j (dx_j sum(xq)): the
  scales apply once per (row, x row, sub-block) in fp32, after the MMA, not per element. The 6-bit scales and mins
  come from three 32-bit words of the block header by constant shifts (the sub-block index is unrolled).
- SWAP orientation as in dequant_gemm: W is the MMA's M side (64 rows a warpgroup on Hopper), the batch its N.
  Rows past M and N are clamped (read again, not stored). Split-K and its reduce are dequant_gemm's.
- Q6_K (mmq_q6k_kernel) has signed 6-bit quants and a scale per 16 elements: see its docstring.
H200, bf16 x, x's pre-pass included (tools/sweep_mmq, 2026-12-01): Q4_K at 16 rows 1.45-1.86x dequant_gemm (14336 x
4096: 62.7 -> 39.1 us), at 32 rows 1.1-1.7x, at 64 rows 0.75-0.89x (so not used there); at 4-8 rows 1.1-1.3x the
int8 GEMV; Q6_K 2.5-2.8x its GEMV at 4-8 rows (4096 x 14336: 185 -> 66 us), 1.1-1.3x dequant_gemm at 16. Still at
25-38% of copy bandwidth: the scales' epilogue after each K = 32 MMA, not the bytes, bounds it.
y moves by x's quantization: |dy| <= dequant_gemv_i8.int8_error_bound (about 0.5% of |y| on random data).
These are variant per32; gguf_mmq_sb.py has per32p (the same arithmetic, Q4_K decoded without byte shifts) and
per256 (x per super-block, MMAs combined in int32): mmq(.., variant=), VARIANTS, MMQ_VARIANT.
"""

from __future__ import annotations

import os

import numpy as np

from ir.formats.gguf_quants import row_bytes
from kernels_src.dequant_gemm import dequant_matmul_ref, row_block
from kernels_src.dequant_gemv_i8 import quantize_x
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.gguf_gemv_common import _f16
from kernels_src.split_k import SMS, gemm_out, launch_split_k, sm_count, split_k_for

__all__ = ["MAX_ROWS", "MMQ_QTYPES", "MMQ_TUNED", "MMQ_VARIANT", "VARIANTS", "mmq", "mmq_ref", "mmq_tiles",
           "x_layout"]

MMQ_QTYPES = ("Q4_K", "Q6_K")
SUPER = {"Q4_K": (256, 144), "Q6_K": (256, 210)}  # elements, bytes of a super-block


def _byte(words, k: int):
    """Byte k of the 12 scale bytes held in words [w0, w1, w2] (uint32 tiles)."""
    return (words[k // 4] >> (8 * (k % 4))) & 0xFF


def _q4k_scale_min(words, j: int):
    """(scale, min) of sub-block j, 6 bits each, as ggml's get_scale_min_k4 reads them."""
    if j < 4:
        return _byte(words, j) & 63, _byte(words, j + 4) & 63
    return ((_byte(words, j + 4) & 0xF) | ((_byte(words, j - 4) >> 6) << 4),
            (_byte(words, j + 4) >> 4) | ((_byte(words, j) >> 6) << 4))


def _program(m_rows, n_rows, w, xq, w_stride, xq_stride, steps_per_split, BLOCK_M, BLOCK_N, PDL):
    """(m, n, W row pointers, clamped x rows, x's K-major [32, BLOCK_M] sub-block pointers, first super-block) of
    this program; with PDL it then waits for the x pre-pass (and lets the kernel after it start)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = w + tl.minimum(n, n_rows - 1).to(tl.int64) * w_stride  # past N: the last row, not stored
    mc = tl.minimum(m, m_rows - 1).to(tl.int64)  # past M: the last row, not stored
    if PDL:
        tl.wait_prior_grid()
        tl.launch_dependents()
    return m, n, wrow, mc, xq + mc[None, :] * xq_stride + tl.arange(0, 32)[:, None], tl.program_id(2) * steps_per_split


def _finish(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, BLOCK_M, BLOCK_N,
            LOOP_STAGES: int = 0):
    """The K loop (acc = step(super-block, acc)) over this program's split, and the store of its tile of y (or of
    its split's fp32 partial): acc is [BLOCK_N, BLOCK_M] (W @ x.T). LOOP_STAGES (0: none): the loop software-pipelined
    over that many stages (LOOP_STAGES_ENV)."""
    acc = tl.fori_loop(lo, tl.minimum(lo + steps_per_split, n_steps), step, tl.zeros((BLOCK_N, BLOCK_M), tl.float32),
                       stages=LOOP_STAGES)
    dst = y + tl.program_id(2).to(tl.int64) * split_stride
    tl.store(dst + m[None, :] * y_stride + n[:, None], acc, mask=(m[None, :] < m_rows) & (n[:, None] < n_rows))


def _q6k_quants(blk, e):
    """(x's 32-element block j, the first of its two 16-element scales' index, int8 quants [BLOCK_N, 32]) of each
    chunk of the Q6_K super-blocks at blk."""
    for h in range(2):
        qh = tl.load(blk[:, None] + 128 + 32 * h + e[None, :])
        ql = [tl.load(blk[:, None] + 64 * h + 32 * j + e[None, :]) for j in range(2)]
        for k in range(4):
            nib = (ql[k % 2] >> 4) if k >= 2 else (ql[k % 2] & 15)
            yield 4 * h + k, 8 * h + 2 * k, (nib | (((qh >> (2 * k)) & 3) << 4)).to(tl.int8) - 32


def _q6k_head(blk):
    """(d, the pointer to the 16 int8 scales) of the Q6_K super-blocks at blk."""
    return tl.load((blk + 208).to(tl.pointer_type(tl.float16))).to(tl.float32), blk.to(tl.pointer_type(tl.int8)) + 192


def _q4k_head(blk):
    """(d, dmin, the three words of 6-bit scales and mins) of the Q4_K super-blocks at blk (4-byte aligned)."""
    head = tl.load(blk.to(tl.pointer_type(tl.uint32)))
    words = [tl.load((blk + 4 * (i + 1)).to(tl.pointer_type(tl.uint32))) for i in range(3)]
    return _f16(head), _f16(head >> 16), words


def mmq_q4k_kernel(w, xq, xd, xs, y, m_rows, n_rows, w_stride, xq_stride, xd_stride, y_stride, split_stride, n_steps,
                   steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
                   LOOP_STAGES: tl.constexpr = 0):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., super-blocks s * steps_per_split..; y is the
    output (split_stride 0) or fp32 partials [SPLIT, M, N]. xq int8 [M, K]; xd, xs fp32 [M, K / 32] (d and
    d * sum(q) of each 32-element block, strided alike)."""
    m, n, wrow, mc, xrow, lo = _program(m_rows, n_rows, w, xq, w_stride, xq_stride, steps_per_split, BLOCK_M,
                                        BLOCK_N, PDL)
    e = tl.arange(0, 32)
    drow, srow = xd + mc * xd_stride, xs + mc * xd_stride

    def step(sb, acc):
        blk = wrow + sb * 144
        d, dmin, words = _q4k_head(blk)
        for c in range(4):
            v = tl.load(blk[:, None] + 16 + 32 * c + e[None, :])  # [BLOCK_N, 32] bytes
            for h in range(2):
                j = 2 * c + h
                q = ((v >> 4) if h else (v & 15)).to(tl.int8)
                xv = tl.load(xrow + sb * 256 + 32 * j)
                dx = tl.load(drow + sb * 8 + j)
                sx = tl.load(srow + sb * 8 + j)
                sc, mn = _q4k_scale_min(words, j)
                dot = tl.dot(q, xv).to(tl.float32)
                acc = acc + dot * ((d * sc.to(tl.float32))[:, None] * dx[None, :]) \
                    - (dmin * mn.to(tl.float32))[:, None] * sx[None, :]
        return acc

    _finish(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, BLOCK_M, BLOCK_N,
            LOOP_STAGES)


def mmq_q6k_kernel(w, xq, xd, xs, y, m_rows, n_rows, w_stride, xq_stride, xd_stride, y_stride, split_stride, n_steps,
                   steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
                   LOOP_STAGES: tl.constexpr = 0):
    """mmq_q4k_kernel for Q6_K (ql[128], qh[64], int8 scales[16], d; 210-byte super-blocks, so 2-byte aligned):
    in half h, chunk k's 32 elements 128h + 32k + l are nibble k // 2 of ql[64h + 32(k % 2) + l] with bits 2k, 2k + 1
    of qh[32h + l] on top, minus 32: signed int8 operands, no offset term. The chunk meets one int8 block of x, but
    its two 16-element halves have scales of their own (8h + 2k + l // 16): two MMAs, each with the other half's
    quants zeroed (MMAs are cheap here, per-element work is not; the whole chunk's MMA minus one half's doubled the
    SASS: q then feeds two operand layouts). xs is unused (no minimums)."""
    m, n, wrow, mc, xrow, lo = _program(m_rows, n_rows, w, xq, w_stride, xq_stride, steps_per_split, BLOCK_M,
                                        BLOCK_N, PDL)
    e = tl.arange(0, 32)
    first = (e < 16)[None, :]
    drow = xd + mc * xd_stride

    def step(sb, acc):
        blk = wrow + sb * 210
        d, sc = _q6k_head(blk)
        for j, si, q in _q6k_quants(blk, e):
            xv = tl.load(xrow + sb * 256 + 32 * j)
            dx = tl.load(drow + sb * 8 + j)
            for u in range(2):
                part = tl.dot(tl.where(first if u == 0 else ~first, q, 0).to(tl.int8), xv).to(tl.float32)
                s = tl.load(sc + si + u).to(tl.float32)
                acc = acc + part * ((d * s)[:, None] * dx[None, :])
        return acc

    _finish(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, BLOCK_M, BLOCK_N,
            LOOP_STAGES)


KERNELS = {"Q4_K": mmq_q4k_kernel, "Q6_K": mmq_q6k_kernel}


# --- host side -------------------------------------------------------------------------------------------------

MIN_SPLIT_STEPS = 2  # super-blocks a split keeps at least
# The runner takes this GEMM from MIN_ROWS rows (H200): at 2 rows the GEMVs are 1.3-2x faster; at 4-8 this is
# 1.1-1.3x faster than Q4_K's and 1.1-2.8x than Q6_K's.
MIN_ROWS = {"Q4_K": 4, "Q6_K": 4}
# per32: x to int8 per 32 elements, each K = 32 MMA scaled in fp32 (this file's kernels); per32p: the same
# arithmetic with gguf_mmq_sb's decoding of Q4_K (high nibbles without byte shifts, packed scales; Q6_K as per32);
# per256: x per 256, a super-block's MMAs combined in int32 (gguf_mmq_sb.py), about 2x per32's error from x on real
# activations (as ggml's CPU dot products, whose Q8_K is per 256). per256 is the default: on an H200 (2026-12-03) its
# Q4_K at 16 rows of 14336 x 4096 took 31.7 us against per32's 38.4 and per32p's 35.9 (tools/sweep_mmq), and a
# Q4_K_M Llama-3-8B decoded batch 16 at 2,703 tok/s against 2,425 with per32 (tools/bench_gguf --mmq); at 64 rows
# it lost to dequant_gemm (4,554 against 4,878), so MAX_ROWS stays 32; again on 2026-12-05 with x's codes from the
# norm and 64-row tiles (sweep_mmq --ms 64: 0.61-0.82x dequant_gemm; the step 4,606 against 7,224 tok/s).
VARIANTS = ("per32", "per32p", "per256")
# The K loop software-pipelined over this many stages (tl.range's num_stages; 0: the plain loop). Plain, W's loads
# are issued and waited for within their step (sm_90: 40 LDG a super-block in the Q4_K per256 loop at 16 rows; Triton
# pipelines only x's, which feed a dot directly), so each of a program's few steps (8 at 14336 x 4096, split 2) waits
# a load's latency; pipelined, W comes by cp.async one or more steps ahead (no LDG left in the loop, 167 registers
# against 174). Not yet timed (GPU_QUEUE): LLM_ENGINE_MMQ_LOOP_STAGES=2|3 sets it where MMQ_TUNED says nothing.
# Q6_K gains nothing from it: its 210-byte super-blocks are 2-byte aligned, and cp.async moves 4 bytes or more.
LOOP_STAGES_ENV = "LLM_ENGINE_MMQ_LOOP_STAGES"
LOOP_STAGES = int(os.environ.get(LOOP_STAGES_ENV, "0") or 0)


def loop_stages(given: int | None = None) -> int:
    """The K loop's stages a launch takes: `given`, else LOOP_STAGES (the MMQs of int_group_mmq and moe_mmq too)."""
    return LOOP_STAGES if given is None else given
MMQ_VARIANT = "per256"
MAX_ROWS = 32  # and up to here: at 64 rows dequant_gemm is 1.1-1.3x faster (Q4_K, H200)
# (qtype, row bucket 16 / 32, n, k) -> launcher keywords measured best on an H200 (tools/sweep_mmq.py prints this
# literal; 2026-12-01 for per32, whose entries name no variant: 1.1-1.9x dequant_gemm's tuned tiles; 2026-12-03 the
# per256 one); a problem not listed, or listed for another variant, takes mmq_tiles' rule.
MMQ_TUNED: dict[tuple[str, int, int, int], dict] = {
    # per256 at 16 rows (tools/sweep_mmq --ms 16 --variants per256, H200, 2026-12-05): 1.1-1.9x dequant_gemm, and
    # 2-11% ahead of mmq_tiles' rule (GPU_CHECK_STEPS=mmq_sweep16; docs/BENCHMARKS.md)
    ('Q4_K', 16, 28672, 4096): {'variant': 'per256', 'block_n': 128, 'num_warps': 4, 'num_stages': 3, 'split_k': 1},
    ('Q4_K', 16, 14336, 4096): {'variant': 'per256', 'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 2},
    ('Q4_K', 16, 4096, 14336): {'variant': 'per256', 'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 8},
    ('Q4_K', 16, 6144, 4096): {'variant': 'per256', 'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'split_k': 4},
    ('Q4_K', 16, 5120, 4096): {'variant': 'per256', 'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 8},
    ('Q4_K', 16, 4096, 4096): {'variant': 'per256', 'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'split_k': 4},
    ('Q6_K', 16, 4096, 14336): {'variant': 'per256', 'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'split_k': 16},
    ('Q6_K', 16, 1024, 4096): {'variant': 'per256', 'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'split_k': 16},
    ('Q6_K', 16, 128256, 4096): {'variant': 'per256', 'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'split_k': 2},
    # per32's (entries without a variant; 2026-12-01), not read by per256
    ('Q4_K', 16, 128256, 4096): {'block_n': 64, 'num_warps': 4, 'num_stages': 3, 'split_k': 1},
    ('Q4_K', 32, 28672, 4096): {'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 1},
    ('Q4_K', 32, 14336, 4096): {'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 2},
    ('Q4_K', 32, 4096, 14336): {'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 8},
    ('Q4_K', 32, 6144, 4096): {'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 4},
    ('Q4_K', 32, 4096, 4096): {'block_n': 64, 'num_warps': 4, 'num_stages': 2, 'split_k': 4},
    ('Q4_K', 32, 128256, 4096): {'block_n': 128, 'num_warps': 4, 'num_stages': 2, 'split_k': 2},
}


def mmq_tiles(qtype: str, m: int, n: int, k: int, sms: int = SMS, variant: str | None = None) -> dict:
    """BLOCK_M (16 / 32 / 64 by M), BLOCK_N, SPLIT (a power of two, grown until every SM has WAVE_PROGRAMS
    programs while each split keeps MIN_SPLIT_STEPS super-blocks and the partials fit PART_BYTES), num_warps, and
    the variant (VARIANTS: the one given, else MMQ_TUNED's for the problem, else MMQ_VARIANT); an entry's tiles
    apply to its own variant only (per32 where it names none). per256 at 64 rows
    takes 8 warps (two warpgroups share the rows, each decoding the weights: at 4 the sm_90 build spills)."""
    steps = k // SUPER[qtype.upper()][0]
    block_m, block_n = row_block(m), 64
    split = split_k_for(m, n, block_m, block_n, steps, sms, MIN_SPLIT_STEPS)
    tuned = MMQ_TUNED.get((qtype.upper(), block_m, n, k), {})
    variant = variant or tuned.get("variant") or MMQ_VARIANT
    if tuned.get("variant", "per32") != variant:  # an entry without one was measured for per32 (2026-12-01)
        tuned = {}
    warps = 8 if variant == "per256" and block_m >= 64 else 4
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, num_warps=warps, num_stages=None, variant=variant,
               LOOP_STAGES=LOOP_STAGES)
    cfg.update({_KEYS[key]: v for key, v in tuned.items()})
    return cfg


_KEYS = dict(block_m="BLOCK_M", block_n="BLOCK_N", split_k="SPLIT", num_warps="num_warps", num_stages="num_stages",
             variant="variant", loop_stages="LOOP_STAGES")


def _per32_pre_pass(x2, qtype: str, block_m: int, target: str):
    return quantize_x(x2, target=target, sums=True)


def _variant(name: str) -> tuple[dict, object, bool]:
    """(kernels by qtype, x pre-pass(x2, qtype, block_m, target) -> (q, d, sums), whether the sums have a stride
    of their own) of a variant."""
    if name == "per32":
        return KERNELS, _per32_pre_pass, False
    from kernels_src import gguf_mmq_sb

    if name == "per32p":
        return {"Q4_K": gguf_mmq_sb.mmq_p32_q4k_kernel, "Q6_K": mmq_q6k_kernel}, _per32_pre_pass, False
    if name == "per256":
        return gguf_mmq_sb.KERNELS, gguf_mmq_sb.pre_pass, True
    raise ValueError(f"mmq: unknown variant {name!r} (known: {', '.join(VARIANTS)})")


def x_layout(qtype: str, m: int, n: int, k: int, variant: str | None = None) -> str:
    """The x pre-pass an [m, k] x [n, k] problem's mmq reads: "per32" (quantize_x with sums), "per256" (quantize_x256,
    fp32 sums) or "per256-split" (fp16 sum pairs: Q4_K from MMA_MINS_ROWS rows): x's int8 form made elsewhere
    (backends/cuda/x_int8_fusion) serves every GEMM of that x whose layout it is."""
    cfg = mmq_tiles(qtype, m, n, k, variant=variant)
    return _layout(cfg["variant"], qtype, cfg["BLOCK_M"])


def _layout(variant: str, qtype: str, block_m: int) -> str:
    if variant != "per256":  # per32p reads per32's pre-pass
        return "per32"
    from kernels_src.gguf_mmq_sb import MMA_MINS_ROWS

    return "per256-split" if qtype.upper() == "Q4_K" and block_m >= MMA_MINS_ROWS else "per256"


def _check_xq(xq, m: int, k: int, layout: str) -> None:
    """A given pre-pass triple has the shapes of `layout`'s (a mismatch would read x's codes wrongly, silently)."""
    q, d, sums = xq
    group, sums_cols = (32, k // 32) if layout == "per32" else (256, k // 16 if layout.endswith("split") else k // 32)
    if tuple(q.shape) != (m, k) or tuple(d.shape) != (m, k // group) or tuple(sums.shape) != (m, sums_cols):
        raise ValueError(f"mmq: x's given int8 form {[tuple(a.shape) for a in xq]} is not the {layout} pre-pass of "
                         f"[{m}, {k}]")


def mmq(x2, w, qtype: str, *, out=None, target: str = "numpy", pdl: bool | None = None, xq=None, **over):
    """y [M, N] = x2 [M, K] @ dequantize(w).T for raw GGUF blocks w (uint8 [N, >= row_bytes], rows 4-byte
    aligned), x quantized to int8 first (or given as xq: the variant's pre-pass triple, quantize_x(.., sums=True)
    for per32 or gguf_mmq_sb.pre_pass (its layout depends on BLOCK_M) for per256, to share one pre-pass between
    GEMMs of one input); out (made
    when not given) in x2's dtype. `over` overrides mmq_tiles (block_m, block_n, split_k, num_warps, num_stages,
    variant, loop_stages)."""
    qtype = qtype.upper()
    if qtype not in MMQ_QTYPES:
        raise ValueError(f"mmq: unsupported qtype {qtype!r} (supported: {', '.join(MMQ_QTYPES)})")
    m, k = x2.shape
    n = w.shape[0]
    elems, size = SUPER[qtype]
    if k <= 0 or k % elems or len(w.shape) != 2 or w.shape[1] < row_bytes(qtype, k) or elem_stride(w, 1) != 1:
        raise ValueError(f"x [{m}, {k}] and {qtype} weights {tuple(w.shape)} do not make a GEMM")
    addr = w.data_ptr() if hasattr(w, "data_ptr") else w.__array_interface__["data"][0]
    align = 4 if qtype == "Q4_K" else 2
    if addr % align or (n > 1 and elem_stride(w, 0) % align):
        raise ValueError(f"{qtype} weight rows must start {align}-byte aligned (the block headers are read as words)")
    cfg = mmq_tiles(qtype, m, n, k, sm_count(x2), over.get("variant"))
    cfg.update({_KEYS[key]: v for key, v in over.items() if v is not None})
    variant = cfg.pop("variant")
    kernels, pre_pass, sums_stride = _variant(variant)
    out = gemm_out(x2, out, n)
    if m == 0 or n == 0:
        return out
    if xq is None:
        xq = pre_pass(x2 if elem_stride(x2, 1) == 1 else x2.contiguous(), qtype, cfg["BLOCK_M"], target)
    else:
        _check_xq(xq, m, k, _layout(variant, qtype, cfg["BLOCK_M"]))
    xq, xd, xs = xq
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT")
    pdl = use_pdl(target, pdl)
    kern = compile(kernels[qtype], target, num_warps=nw, num_stages=ns, launch_pdl=pdl, PDL=pdl, **cfg)
    args = (m, n, elem_stride(w, 0), elem_stride(xq, 0), elem_stride(xd, 0))
    if sums_stride:
        args += (elem_stride(xs, 0),)
    return launch_split_k(kern, (w, xq, xd, xs), args, out, k // elems, split, cfg["BLOCK_M"], cfg["BLOCK_N"],
                          target, pdl)


def mmq_ref(x: np.ndarray, w: np.ndarray, qtype: str, variant: str = "per32") -> np.ndarray:
    """What mmq computes, in float64: x quantized as the variant's pre-pass does (numpy), times W decoded by our
    numpy dequantizer. Against dequant_matmul_ref(x, ...) it differs by x's quantization alone."""
    from kernels_src.dequant_gemv_i8 import quantize_x_ref
    from kernels_src.gguf_mmq_sb import quantize_x256_ref

    if variant not in VARIANTS:
        raise ValueError(f"mmq_ref: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    q, d = (quantize_x256_ref if variant == "per256" else quantize_x_ref)(np.asarray(x, np.float32))
    group = x.shape[1] // d.shape[1]
    xd = (q.reshape(q.shape[0], -1, group).astype(np.float32) * d[..., None]).reshape(q.shape)
    return dequant_matmul_ref(xd, w, qtype)
