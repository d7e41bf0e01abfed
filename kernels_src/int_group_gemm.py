"""Dequantizing GEMM y[M, N] = x[M, K] @ W.T for 9..256 rows straight from integer-group blocks (GPTQ, AWQ,
compressed-tensors in the intgroup layout of ir/formats/int_groups.py), on tensor cores: DSL kernel, launcher.

The Marlin-class path: W's packed words are read once per BLOCK_M rows of x, unpacked and scaled in registers and fed
to `tl.dot`; nothing is written back but y. (The GEMV, kernels_src/int_group_gemv.py, re-reads W for every few rows;
dequantizing W to fp16 for cuBLAS writes and re-reads the whole matrix.)
- A program owns a [BLOCK_M, BLOCK_N] tile of y and walks K a step of KG * SUB inputs at a time: KG whole groups
  (SUB = GROUP, for groups of up to STEP_ELEMS) or a SUB-wide slice of one group (long groups, per-channel -1). Its
  BLOCK_N rows' q words of the step are one [BLOCK_N, KG, SUB / PER] tile (PER = 32 / BITS fields a word) beside
  their groups' scales and biases [BLOCK_N, KG, 1]; the fields, shifted out along a new last axis, make
  [BLOCK_N, KG, SUB / PER, PER], which read row-major is the step's inputs in stored order (field j of word c is input
  c * PER + j), so x's step is one contiguous [BLOCK_M, KG * SUB] load.
- Each field decodes as q * scale + bias (fp32, the layout's affine form: exact for fp16/bf16 scales), rounded once
  to x's dtype for the dot; accumulation is fp32.
- SWAP (default): the dot is W [BLOCK_N, k] @ x.T [k, BLOCK_M], so the dequantized W is the MMA's register operand
  (Hopper's wgmma takes A from registers, 64 rows a warpgroup) and the batch its N.
- Rows of x past M and of W past N are clamped (read again, not stored), so no load is masked; split-K (small grids:
  the down projection at 16 rows) shares dequant_gemm's fp32 partials and reduce kernel.
The reference is int_group_gemv_ref (x @ W.T with the numpy dequantizer).
"""

from __future__ import annotations

import functools
import os

from kernels_src import gemm_tuned
from kernels_src.dequant_gemm import _pow2_divisor
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.int_group_gemm_gather import int_group_gemm_gather_kernel
from kernels_src.int_group_gemm_stream import accs_for, int_group_gemm_stream_kernel, permute_x, stream_bk, stream_fits
from kernels_src.int_group_gemv import _check, _words_view
from kernels_src.int_group_gemv import int_group_gemv_ref as int_group_matmul_ref
from kernels_src.int_group_mmq import launch_mmq, mmq_fits, mmq_step
from kernels_src.split_k import gemm_out, launch_split_k, sm_count, split_k_for, split_k_tile

__all__ = ["MAX_ROWS", "VARIANTS", "default_tiles", "int_group_matmul", "int_group_matmul_ref"]

MAX_ROWS = 256  # the rows it is meant for, above the GEMV's 8 (any M runs: BLOCK_M rows a program)


def _shifts(BITS: int):
    """Bit offsets [PER] of a word's fields: input j of a word at bits BITS * j (low bits first)."""
    return tl.arange(0, 32 // BITS) * BITS


def _decode(q, scale, bias):
    """Affine decode of unsigned q with its group's scale and bias (bias = -zero * scale), in fp32."""
    return q.to(tl.float32) * scale + bias


def int_group_gemm_kernel(w, x, y, m_rows, n_rows, w_stride, x_stride, y_stride, split_stride, n_steps,
                          steps_per_split, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SUB: tl.constexpr, KG: tl.constexpr, SWAP: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Program (i, j, s): y rows BLOCK_M i.., columns BLOCK_N j.., steps s * steps_per_split.. of K (KG * SUB inputs
    each); w is int32 words [N, row_words]; y is the output (split_stride 0) or fp32 partials [SPLIT, M, N]."""
    PER = 32 // BITS
    BW, STEP = 2 + GROUP // PER, KG * SUB  # words a block, inputs a step
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(n, n_rows - 1)  # past N: the last row, not stored
    wrow = w + row.to(tl.int64)[:, None, None] * w_stride + tl.arange(0, KG)[None, :, None] * BW  # [N, KG, 1]
    sw = tl.arange(0, SUB // PER)[None, None, :]  # a slice's q words
    xrow = x + tl.minimum(m, m_rows - 1).to(tl.int64)[:, None] * x_stride + tl.arange(0, STEP)[None, :]
    lo = tl.program_id(2) * steps_per_split
    if PDL:  # x is an earlier kernel's output
        tl.wait_prior_grid()
        tl.launch_dependents()

    def step(it, acc):
        first = it * STEP  # the step's first input: in group first // GROUP, at first % GROUP of it
        blk = wrow + (first // GROUP) * BW
        scale = tl.load(blk).to(tl.float32, bitcast=True)[:, :, :, None]  # [N, KG, 1, 1]
        bias = tl.load(blk + 1).to(tl.float32, bitcast=True)[:, :, :, None]
        words = tl.load(blk + 2 + (first % GROUP) // PER + sw)  # [N, KG, SUB / PER]
        q = (words[:, :, :, None] >> _shifts(BITS)[None, None, None, :]) & ((1 << BITS) - 1)
        wv = tl.reshape(_decode(q, scale, bias), (BLOCK_N, STEP)).to(xrow.dtype.element_ty)
        xv = tl.load(xrow + first)
        return tl.dot(wv, tl.trans(xv), acc) if SWAP else tl.dot(xv, tl.trans(wv), acc)

    split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)


# --- host side -------------------------------------------------------------------------------------------------

STEP_ELEMS = 128  # inputs of a row a step (a group of 128 in one step: 16 words a row at 4 bits)
MIN_SPLIT_STEPS = 4  # steps a split keeps at least (each ends in a partial's store and a read in the reduce)
# rows bucket -> tiles (not yet swept on an H200: dequant_gemm's measured shapes for Q4_K, whose 4.5 bits a weight
# and 128-input steps are the closest); M above 64 takes 128-row tiles, so 256 rows read W twice, not four times
TILES = {
    16: dict(BLOCK_M=16, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=3),
    32: dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=3),
    64: dict(BLOCK_M=64, BLOCK_N=128, SWAP=True, num_warps=8, num_stages=3),
    128: dict(BLOCK_M=128, BLOCK_N=64, SWAP=True, num_warps=8, num_stages=3),  # 128 x 128 spills at these steps
}
# mmq's tiles by rows bucket where TUNED has no entry (sm_90 AOT builds of these spill nothing,
# tests/test_kernels_int_group_mmq); the H200's sweep (2026-12-05) chose 64 x 64 at 4 warps at 64 rows on every
# Llama-3-8B shape, and 128 x 64 at 4 warps at 128
MMQ_TILES = {
    16: dict(BLOCK_M=16, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=3),
    32: dict(BLOCK_M=32, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=3),
    64: dict(BLOCK_M=64, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=3),
    128: dict(BLOCK_M=128, BLOCK_N=64, SWAP=True, num_warps=4, num_stages=3),
}
_KEYS = dict(block_m="BLOCK_M", block_n="BLOCK_N", sub="SUB", groups="KG", split_k="SPLIT", swap="SWAP",
             num_warps="num_warps", num_stages="num_stages", bk="BK", accs="ACCS", prefetch="PREFETCH",
             loop_stages="LOOP_STAGES")
# "blocked": int_group_gemm_kernel (words [N, KG, SUB / PER] unpacked along a new axis, then reshaped); "gather":
# kernels_src/int_group_gemm_gather.py (a word a weight element, in the dot's order); "stream":
# kernels_src/int_group_gemm_stream.py (the word tile split by field, a dot each, x permuted to match). The GPU sweep
# (tools/sweep_gemm --qtypes int4g128) decides the default: stream where its step tiles the row (stream_fits), whose
# own tiles beat blocked's 1.6-3.3x at 16 and 64 rows on every Llama-3-8B shape of an H200 (2026-12-03, 22:31 UTC);
# blocked elsewhere. "mmq": kernels_src/int_group_mmq.py (x to int8 per step, W's q bytes as int8 MMA operands),
# where mmq_fits. On the H200 (tools/sweep_gemm --variants stream,mmq, 2026-12-05) its best tiles beat stream's at 16,
# 64 and 128 rows on every Llama-3-8B shape, 1.1-1.6x (gate_up at 64 rows 102.6 -> 66.9 us): TUNED names it there.
# Elsewhere stream stays the default (x's int8 per 128 inputs moves y by more than stream's bf16 rounding; the tests'
# tolerances and other shapes' tiles are stream's) unless LLM_ENGINE_INT_MMQ=1 (MMQ True: mmq wherever it fits, TUNED's
# tiles then only from an entry naming it); LLM_ENGINE_INT_MMQ=0 (MMQ False) skips TUNED's mmq entries too.
VARIANTS = ("blocked", "gather", "stream", "mmq")
MMQ = {"1": True, "0": False}.get(os.environ.get("LLM_ENGINE_INT_MMQ", ""))
VARIANT = "stream"
FALLBACK = "blocked"  # where VARIANT's step does not tile the row
GATHER_BK = 64  # inputs a gather step (its word tile is BLOCK_N x BK 32-bit loads: 32 KB a stage at BLOCK_N 128)


# (bits, group, rows bucket, n, k) -> launcher keywords (variant and bk included) measured best on a GPU:
# tools/sweep_gemm --qtypes int4g128 prints this literal; a problem not listed takes TILES and the rules.
TUNED: dict[tuple[int, int, int, int, int], dict] = {  # tools/sweep_gemm --variants on an H200
    # 1024 x 4096 (k or v alone; the engine runs them fused into qkv): the evening sweep, before stream existed.
    (4, 128, 16, 1024, 4096):
        dict(variant="blocked", block_m=16, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=8),
    (4, 128, 64, 1024, 4096):
        dict(variant="blocked", block_m=64, block_n=32, swap=True, num_warps=4, num_stages=3, split_k=8),
    # `sweep_gemm --variants stream,mmq --ms 16,64,128 --quick` on the H200, 2026-12-05: mmq's best tiles, 1.1-1.6x
    # stream's best (LLM_ENGINE_INT_MMQ=0 skips them: stream at its default tiles)
    (4, 128, 16, 4096, 4096):
        dict(variant="mmq", block_m=16, block_n=128, swap=True, num_warps=8, num_stages=3, split_k=8),
    (4, 128, 16, 4096, 14336):
        dict(variant="mmq", block_m=16, block_n=128, swap=True, num_warps=8, num_stages=3, split_k=8),
    (4, 128, 16, 6144, 4096):
        dict(variant="mmq", block_m=16, block_n=128, swap=True, num_warps=4, num_stages=3, split_k=8),
    (4, 128, 16, 28672, 4096):
        dict(variant="mmq", block_m=16, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=2),
    (4, 128, 64, 4096, 4096):
        dict(variant="mmq", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=8),
    (4, 128, 64, 4096, 14336):
        dict(variant="mmq", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=8),
    (4, 128, 64, 6144, 4096):
        dict(variant="mmq", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=4),
    (4, 128, 64, 28672, 4096):
        dict(variant="mmq", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=2),
    (4, 128, 128, 4096, 4096):
        dict(variant="mmq", block_m=128, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=4),
    (4, 128, 128, 4096, 14336):
        dict(variant="mmq", block_m=128, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=4),
    (4, 128, 128, 6144, 4096):
        dict(variant="mmq", block_m=128, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=2),
    (4, 128, 128, 28672, 4096):
        dict(variant="mmq", block_m=128, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=1),
    # the output projection (sweep_gemm --variants stream,mmq --ms 16,64,128 --shapes 128256x4096, H200, 2026-12-05):
    # mmq 1.2-1.8x stream's best; untuned it ran as stream (373 us of a 6.2 ms batch-64 step)
    (4, 128, 16, 128256, 4096):
        dict(variant="mmq", block_m=16, block_n=128, swap=True, num_warps=4, num_stages=3, split_k=1),
    (4, 128, 64, 128256, 4096):
        dict(variant="mmq", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=4, split_k=2),
    (4, 128, 128, 128256, 4096):
        dict(variant="mmq", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=4, split_k=1),
}


def rows_bucket(m: int) -> int:
    return next(b for b in (16, 32, 64) if m <= b) if m <= 64 else 128


def step_shape(group: int, k: int, step_elems: int = STEP_ELEMS) -> tuple[int, int]:
    """(SUB, KG) of a step: whole groups (as many as fit step_elems and divide the row's) or a slice of one group,
    the largest power of two dividing it (groups are multiples of 32, so 32 at least)."""
    sub = _pow2_divisor(group, step_elems)
    kg = _pow2_divisor(k // group, step_elems // group) if sub == group else 1
    return sub, kg


def default_tiles(m: int, n: int, k: int, bits: int, group: int, sms: int = 132, variant: str | None = None) -> dict:
    """BLOCK_M, BLOCK_N, SWAP, num_warps, num_stages from TILES (MMQ_TILES for variant mmq) by rows bucket, SUB and KG
    from step_shape, and SPLIT (a power of two) grown until the grid fills the GPU while each split keeps
    MIN_SPLIT_STEPS steps; then the TUNED entry's (for mmq only an entry naming it)."""
    mmq = variant == "mmq"
    cfg = dict((MMQ_TILES if mmq else TILES)[rows_bucket(m)])
    cfg["SUB"], cfg["KG"] = step_shape(group, k)
    steps = k // ((mmq_step(bits, group, k) or STEP_ELEMS) if mmq else cfg["SUB"] * cfg["KG"])
    cfg["SPLIT"] = split_k_for(m, n, cfg["BLOCK_M"], cfg["BLOCK_N"], steps, sms, MIN_SPLIT_STEPS)
    tuned = tuned_entry(bits, group, m, n, k)
    if mmq and tuned.get("variant") != "mmq":
        tuned = {}
    cfg.update({_KEYS[key]: v for key, v in tuned.items() if key in _KEYS})
    return cfg


def tuned_variant(m: int, n: int, k: int, bits: int, group: int) -> str:
    """mmq where LLM_ENGINE_INT_MMQ=1 (MMQ) and it fits, else the variant TUNED names for the problem (its tiles
    were measured with it; not mmq under LLM_ENGINE_INT_MMQ=0), else VARIANT where it takes the row, else FALLBACK."""
    if MMQ and mmq_fits(bits, group, k):
        return "mmq"
    variant = tuned_entry(bits, group, m, n, k).get("variant")
    if variant and (variant != "mmq" or (MMQ is not False and mmq_fits(bits, group, k))):
        return variant
    return VARIANT if VARIANT != "stream" or stream_fits(bits, k) else FALLBACK


def tuned_entry(bits: int, group: int, m: int, n: int, k: int) -> dict:
    """The problem's TUNED entry: LLM_ENGINE_GEMM_TUNED's file first (kernels_src/gemm_tuned.py), then TUNED."""
    key = (bits, group, rows_bucket(m), n, k)
    return _env_tuned().get(key) or TUNED.get(key, {})


@functools.cache
def _env_tuned() -> dict:
    def key_of(r):
        t = gemm_tuned.INT_TYPE.fullmatch(r["type"].lower())
        return (int(t[1]), int(t[2]), rows_bucket(r["m"]), r["n"], r["k"]) if t else None
    return gemm_tuned.table(key_of)


def gather_bk(group: int, k: int, bk: int | None = None) -> int:
    """The gather variant's BK: GATHER_BK's largest power-of-two divisor of the group (32 at least), or the one
    given, checked to divide the group or to be whole groups dividing the row."""
    bk = bk or _pow2_divisor(group, GATHER_BK)
    if k % bk or (group % bk and bk % group):
        raise ValueError(f"a gather step of {bk} inputs does not tile groups of {group} in a row of {k}")
    return bk


def int_group_matmul(x2, w, bits: int, group: int, *, out=None, target: str = "numpy", pdl: bool | None = None,
                     block_m: int | None = None, block_n: int | None = None, sub: int | None = None,
                     groups: int | None = None, split_k: int | None = None, swap: bool | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, variant: str | None = None,
                     bk: int | None = None, accs: int | None = None, prefetch: bool | None = None,
                     loop_stages: int | None = None, x_mmq: tuple | None = None):
    """y [M, N] = x2 [M, K] @ W.T for intgroup blocks w (uint8 [N, row_bytes] or their int32 words); x2 fp32 / fp16
    / bf16, rows contiguous; out in x2's dtype. The keywords override default_tiles (sub = SUB, groups = KG); variant
    (VARIANTS, default VARIANT) picks the kernel, bk the gather and stream variants' step, accs stream's accumulators
    (1 or 32 / bits; default int_group_gemm_stream.accs_for); mmq takes swap=True only, prefetch (its epilogue's
    loads a step ahead; default int_group_mmq.PREFETCH_OUTPUTS' rule), loop_stages (its K loop pipelined; default
    gguf_mmq.LOOP_STAGES) and x_mmq (x's int8 form as its pre-pass
    makes it, made with x: kernels_src/x_int8_groups; the other variants ignore it)."""
    variant = variant or tuned_variant(x2.shape[0], w.shape[0], x2.shape[1], bits, group)
    if variant not in VARIANTS:
        raise ValueError(f"int_group_matmul: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    w = _words_view(w)
    m, k = x2.shape
    n = w.shape[0]
    _check(w, bits, group, n, k)
    if m and elem_stride(x2, 1) != 1:
        raise ValueError(f"x [{m}, {k}] needs contiguous rows")
    out = gemm_out(x2, out, n)
    if m == 0 or n == 0:
        return out
    cfg = default_tiles(m, n, k, bits, group, sm_count(x2), variant)
    over = dict(block_m=block_m, block_n=block_n, sub=sub, groups=groups, split_k=split_k, swap=swap,
                num_warps=num_warps, num_stages=num_stages, bk=bk, accs=accs, prefetch=prefetch,
                loop_stages=loop_stages)
    cfg.update({_KEYS[key]: v for key, v in over.items() if v is not None})
    sub_, kg = cfg["SUB"], cfg["KG"]
    per = 32 // bits
    if sub_ % per or group % sub_ or (kg > 1 and sub_ != group) or (k // group) % kg:
        raise ValueError(f"a step of {kg} x {sub_} inputs does not tile groups of {group} in a row of {k} "
                         "(sub must divide the group; several groups a step only whole)")
    nw, ns, split, bk = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT"), cfg.pop("BK", None)
    accs = cfg.pop("ACCS", None)
    prefetch, loop_stages = cfg.pop("PREFETCH", None), cfg.pop("LOOP_STAGES", None)
    pdl = use_pdl(target, pdl)
    if variant == "mmq":
        if not cfg["SWAP"]:
            raise ValueError("int_group_matmul: variant mmq runs W @ x.T only (swap=True)")
        return launch_mmq(x2, w, bits, group, out, dict(cfg, PREFETCH=prefetch, LOOP_STAGES=loop_stages), nw, ns,
                          split, target, pdl, x_mmq)
    if variant == "gather":
        step = gather_bk(group, k, bk)
        kern = compile(int_group_gemm_gather_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl, BITS=bits,
                       GROUP=group, PDL=pdl, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=step,
                       SWAP=cfg["SWAP"])
        return launch_split_k(kern, (w, x2), (m, n, elem_stride(w, 0), elem_stride(x2, 0)), out, k // step, split,
                              cfg["BLOCK_M"], cfg["BLOCK_N"], target, pdl)
    if variant == "stream":
        step = stream_bk(bits, k, bk)
        accs = accs or accs_for(bits, cfg["BLOCK_M"], cfg["BLOCK_N"], nw, cfg["SWAP"])
        if accs not in (1, 32 // bits):
            raise ValueError(f"stream takes 1 or {32 // bits} accumulators at {bits} bits, not {accs}")
        kern = compile(int_group_gemm_stream_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl, BITS=bits,
                       GROUP=group, PDL=pdl, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=step,
                       SWAP=cfg["SWAP"], ACCS=accs)
        xp = permute_x(x2, step, bits)
        return launch_split_k(kern, (w, xp), (m, n, elem_stride(w, 0), elem_stride(xp, 0)), out, k // step, split,
                              cfg["BLOCK_M"], cfg["BLOCK_N"], target, pdl)
    kern = compile(int_group_gemm_kernel, target, num_warps=nw, num_stages=ns, launch_pdl=pdl, BITS=bits,
                   GROUP=group, PDL=pdl, **cfg)
    return launch_split_k(kern, (w, x2), (m, n, elem_stride(w, 0), elem_stride(x2, 0)), out, k // (sub_ * kg),
                          split, cfg["BLOCK_M"], cfg["BLOCK_N"], target, pdl)

