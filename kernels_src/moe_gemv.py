"""The fused MoE at small batches: each (token, k) slot's expert as GEMVs, nothing grouped (kernels_src/moe.py takes
this path at up to GEMV_SLOTS slots). DSL kernels and their launch; the reference is moe.moe_experts_ref.

The grouped kernels tile BLOCK_M slots of one expert; at a decode step of one token its 8 slots fill 8 of those
blocks with one real row each, most programs are padding, and each streams its weights in small tiles behind a
dozen array ops that group the slots. Here a program reads its slot's expert id and is a GEMV over that expert's
rows, so the grid depends only on the number of slots S = tokens * top_k (capturable, no host sync) and every
program works:
- gated pass, grid (cdiv(I, tile), S): h[s] = weights[s] * act(gate[e] @ x[t]) * (up[e] @ x[t]), e = ids[s],
  t = s // top_k; the routing weight is folded in here, so the down pass is a plain GEMV.
- down pass, grid (cdiv(H, tile), S): y[s] = down[e] @ h[s]; moe.py sums each token's top_k rows of y.
  The down pass keeps one program per (slot, tile), not per (token, tile) looping over its top_k slots: at one
  token the latter has H / tile programs, 128 at 16 rows for an H200's 132 SMs (one 4-warp program an SM, one
  slot's loads in flight at a time), and only 2-4-row tiles would give each SM several; the slot grid is top_k
  times larger at the same tile, and the sum after it is one small launch. Three launches a layer, dense or GGUF.
Dense stacks: a program multiplies BLOCK_N rows by x over BLOCK_K-wide tiles of K, elementwise in fp32, summing
across K once at the end (no tl.dot: one x row). GGUF stacks: dequant_gemv's kernel body (`_gemv_loop`: its
per-format x_prep / w_load / w_dot, its default tiles at M = 1) over the expert's rows, its base ids[s] * rows *
row stride; gate and up of one format share each step's x (each row of the program is a gate row and an up row, so
half of dequant_gemv's ROWS keeps its loads a step and its registers); of two formats they take two loops.
Every program loads its expert id first, so under PDL it waits before any load (the routing comes from the kernel
before): unlike dequant_gemv, no weight load can overlap the previous kernel.
On int8 x (from I8_MIN_SLOTS slots, or as LLM_ENGINE_MOE_I8 says; Triton only, Q4_K / Q5_K / Q6_K passes: uses_i8) a
pass runs quantize_x over its input first (x [T, H] once per token; h [S, I]) and the kernel reads codes and per-32
scales through dequant_gemv_i8's loads and dp4a dots (I8_FAMILY) in the same _gemv_loop, grid and tiles. h is
quantized by that launch, not in the gated pass's epilogue: a block's scale is the max over 32 rows of h, which a
program of 1-2 rows does not hold (32-row programs would carry 64 accumulators and leave 192 programs at one token).
So five launches a layer instead of three; quantize_x is a plain launch, so the pass after it may load its expert id
and weights before its grid-dependency wait, as dequant_gemv_i8_kernel does, which hides some of that.
"""

from __future__ import annotations

import os

from kernels_src import dequant_gemv as dg
from kernels_src import dequant_gemv_i8 as i8
from kernels_src import moe_gguf
from kernels_src.activations import _act
from kernels_src.dsl import compile, elem_stride, tl
from kernels_src.gguf_gemv_common import _Decode

__all__ = ["GEMV_SLOTS", "GGUF_GEMV_SLOTS", "GGUF_GEMV_SLOTS_PER_EXPERT", "I8", "I8_MIN_SLOTS", "gemv_slots",
           "moe_gemv_kernel", "moe_qgemv_kernel", "run", "stack_fits", "use_gemv", "uses_i8"]

# At most this many slots (tokens * top_k) take the GEMV path, dense and GGUF, and no more slots than experts
# (dense) or four times as many (GGUF). The GEMV reads an expert once per slot that routes to it, the grouped
# kernels once per used expert, so past some batch the grouped kernels win. Measured on an H200
# (`tools/sweep_moe --no-sweep`, Qwen3-30B-A3B's 128 experts of 768, top 8), one layer's MoE, GEMV against grouped:
#   dense bf16: 1 token 27 vs 138 us, 8 tokens 142 vs 242, 16 (128 slots) 274 vs 327, 32 (256 slots) 533 vs 424,
#               64 (512 slots) 1,073 vs 404;
#   Q4_K_M:     1 token 24 vs 238 us, 8 tokens 120 vs 753, 16 229 vs 1,079, 32 (256 slots) 446 vs 1,425,
#               64 (512 slots) 879 vs 1,369, 128 (1,024 slots) 1,745 vs 1,403 (2026-12-02 and -03).
# With few experts (Mixtral's 8 of top-2) slots crowd onto each, and the GEMV streams an expert's stack once for
# each of them where the grouped kernel streams it once: hence the bound by experts.
GEMV_SLOTS = 128
GGUF_GEMV_SLOTS = 512
GGUF_GEMV_SLOTS_PER_EXPERT = 4  # GGUF stacks: up to this many slots an expert (dense: one)
# Dense tiles: at batch 1 the gated pass's 384 programs (8 slots x 48 tiles of 16 rows; 4 warps at 128 registers a
# thread in the sm_90 build) are all resident at once, ~3 an SM, each with a step's loads of [16, 256] of gate and up
# (16 KB) in flight together: ~48 KB an SM, above the ~36 KB an H200 needs (4.8 TB/s x ~1 us / 132 SMs). Triton does
# not pipeline loads that feed no dot across steps, so BLOCK_K sets the bytes in flight, BLOCK_N the program count.
DENSE_TILES = dict(BLOCK_N=16, BLOCK_K=256, num_warps=4)
# The GGUF passes on int8 x (uses_i8). `tools/sweep_moe --tokens 1,8,16 --no-sweep --variants blocked,i8` on the
# H200 (2026-12-04, docs/BENCHMARKS.md; a Qwen3-30B-A3B MoE layer over Q4_K_M-like stacks, top 8): 26.0 / 113.6 /
# 212.5 us on int8 x against 23.4 / 119.9 / 228.1 us on fp x at 1 / 8 / 16 tokens: quantize_x's launch costs more than
# the dp4a loop saves at one token, less from 64 slots. So by default a pass takes it from I8_MIN_SLOTS slots;
# LLM_ENGINE_MOE_I8=1 at every size, =0 never (read once, as LLM_ENGINE_MOE_DEQUANT). I8: None (the slot rule) or that.
I8 = {"1": True, "0": False}.get(os.environ.get("LLM_ENGINE_MOE_I8", ""))
I8_MIN_SLOTS = 64


def moe_gemv_kernel(x, w_a, w_b, y, ids, weights, n_rows, n_cols, n_steps, x_stride, w_e_stride, w_stride, y_stride,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (j, s) over dense stacks [E, n_rows, n_cols]: rows BLOCK_N j.. of expert e = ids[s]. GATED: y[s] =
    weights[s] * act(x[s // TOP_K] @ w_a[e].T) * (x[s // TOP_K] @ w_b[e].T); else y[s] = x[s] @ w_a[e].T. Rows past
    n_rows are clamped (read again, not stored)."""
    if PDL:  # the expert ids, x and the weights come from earlier kernels
        tl.wait_prior_grid()
        tl.launch_dependents()
    slot = tl.program_id(1)
    e = tl.load(ids + slot).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = e * w_e_stride + tl.minimum(n, n_rows - 1).to(tl.int64)[:, None] * w_stride
    xrow = x + (slot // TOP_K if GATED else slot).to(tl.int64) * x_stride
    kk = tl.arange(0, BLOCK_K)[None, :]
    all_n = tl.arange(0, BLOCK_N)[:, None] >= 0  # masks spelled out at each load's full shape

    def step(it, acc_a, acc_b):
        k = it * BLOCK_K + kk
        kmask = k < n_cols
        xv = tl.load(xrow + k, mask=kmask, other=0.0).to(tl.float32)
        acc_a = acc_a + tl.load(w_a + wrow + k, mask=kmask & all_n, other=0.0).to(tl.float32) * xv
        if GATED:
            acc_b = acc_b + tl.load(w_b + wrow + k, mask=kmask & all_n, other=0.0).to(tl.float32) * xv
        return acc_a, acc_b

    zero = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_a, acc_b = tl.fori_loop(0, n_steps, step, (zero, zero))
    out = tl.sum(acc_a, axis=1)
    if GATED:
        out = _act(out, ACT) * tl.sum(acc_b, axis=1) * tl.load(weights + slot).to(tl.float32)
    tl.store(y + slot.to(tl.int64) * y_stride + n, out, mask=n < n_rows)


def moe_qgemv_kernel(x, xd, w_a, w_b, y, ids, weights, n_rows, n_cols, x_stride, xd_stride, a_stride, b_stride,
                     y_stride, TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QTYPE_A: tl.constexpr,
                     QTYPE_B: tl.constexpr, ROWS: tl.constexpr, STEP_A: tl.constexpr, STEP_B: tl.constexpr,
                     PARTS_A: tl.constexpr, PARTS_B: tl.constexpr, SUBNORMAL: tl.constexpr, PDL: tl.constexpr = False,
                     I8: tl.constexpr = False):
    """moe_gemv_kernel over GGUF stacks (blocks [E * n_rows, row bytes]; a_stride, b_stride: their row strides in
    bytes), through dequant_gemv's loop: program (j, s) takes rows ROWS j.. of expert ids[s]. I8: x is quantize_x's
    int8 q (row stride x_stride) and xd its per-32 scales (row stride xd_stride; unused otherwise), through
    dequant_gemv_i8's loads and dp4a dots (one lane part), and under PDL the program waits only before its first x
    load, after the step's weight loads, as dequant_gemv_i8_kernel does: the kernel before it is quantize_x, a plain
    launch, so the ids and everything else before it are complete when it starts."""
    if PDL and not I8:  # the expert ids (which say what to read), x and the weights come from earlier kernels
        tl.wait_prior_grid()
        tl.launch_dependents()
    slot = tl.program_id(1)
    first = tl.load(ids + slot).to(tl.int64) * n_rows  # the expert's first row
    xi = (slot // TOP_K if GATED else slot).to(tl.int64)
    xrow, xdrow = x + xi * x_stride, xd + xi * xd_stride
    dec = _Decode(SUBNORMAL)

    def x_i8(m, b, x_load):
        if PDL and m == 0:
            tl.wait_prior_grid()
        return x_load(xrow, xdrow, b)

    def sums(mats, QTYPE, STEP, PARTS):
        """Each matrix's sums [i * ROWS + r] of the program's rows, and the rows."""
        elems, size = dg.FORMATS[QTYPE]
        if I8:
            x_load, w_load, w_dot, acc_shape = i8.I8_FAMILY[QTYPE]
            rank, PARTS, x_prep = 4, 1, lambda m, b: x_i8(m, b, x_load)
        else:
            rank, acc_shape, x_fp, w_load, w_fp = dg._family(QTYPE, PARTS)
            x_prep, w_dot = lambda m, b: x_fp(xrow, b, dec, PARTS), lambda raw, xp: w_fp(raw, xp, dec)
        rows, accs = dg._gemv_loop([(w + first * s, s) for w, s in mats], n_rows, n_cols, elems, size, 1, ROWS, STEP,
                                   PARTS, rank, acc_shape, x_prep, w_load, w_dot)
        return rows, [tl.sum(a) for a in accs]

    if not GATED:
        rows, out = sums([(w_a, a_stride)], QTYPE_A, STEP_A, PARTS_A)
    else:
        if QTYPE_A == QTYPE_B:  # gate and up share each step's x
            rows, both = sums([(w_a, a_stride), (w_b, b_stride)], QTYPE_A, STEP_A, PARTS_A)
        else:
            rows, both = sums([(w_a, a_stride)], QTYPE_A, STEP_A, PARTS_A)
            both = both + sums([(w_b, b_stride)], QTYPE_B, STEP_B, PARTS_B)[1]
        w_slot = tl.load(weights + slot).to(tl.float32)
        out = [_act(g, ACT) * u * w_slot for g, u in zip(both[:ROWS], both[ROWS:], strict=True)]
    if PDL and I8:  # a program whose loop ran no step has not waited yet (a later wait returns at once)
        tl.wait_prior_grid()
        tl.launch_dependents()
    for row, v in zip(rows, out, strict=True):
        tl.store(y + slot.to(tl.int64) * y_stride + row, v, mask=row < n_rows)


# --- host side -------------------------------------------------------------------------------------------------

def stack_fits(w) -> bool:
    """Whether the GEMV can read stack w: dense (contiguous rows, which moe.py checks), or GGUF rows at the
    alignment dequant_gemv's loads need (16 bytes for Q4_K and Q5_K, 2 for the others)."""
    if not moe_gguf.is_blocks(w):
        return True
    align = dg.ALIGN.get(w.qtype.upper(), 2)
    return dg._addr(w.data) % align == 0 and elem_stride(w.data, 0) % align == 0


def gemv_slots(experts: int, gguf: bool) -> int:
    """The most slots the GEMV path takes over `experts` experts: GEMV_SLOTS and the experts; over GGUF stacks
    GGUF_GEMV_SLOTS and GGUF_GEMV_SLOTS_PER_EXPERT times the experts."""
    return min(GGUF_GEMV_SLOTS, GGUF_GEMV_SLOTS_PER_EXPERT * experts) if gguf else min(GEMV_SLOTS, experts)


def use_gemv(slots: int, experts: int, stacks) -> bool:
    """The rule moe.moe_experts follows: at most gemv_slots slots, over stacks it can read."""
    gguf = any(moe_gguf.is_blocks(w) for w in stacks)
    return slots <= gemv_slots(experts, gguf) and all(stack_fits(w) for w in stacks)


def uses_i8(target: str, *stacks, slots: int | None = None) -> bool:
    """Whether a pass of `slots` slots (None: any) over `stacks` takes the int8-x GEMV: switched on (I8, else
    I8_MIN_SLOTS slots or more), on dequant_gemv_i8.I8_TARGETS, and every stack GGUF blocks of a format with an int8
    path (dequant_gemv_i8.I8_QTYPES: Q4_K, Q5_K, Q6_K)."""
    on = I8 if I8 is not None else slots is None or slots >= I8_MIN_SLOTS
    return on and target in i8.I8_TARGETS and all(
        moe_gguf.is_blocks(w) and w.qtype.upper() in i8.I8_QTYPES for w in stacks)


def _gguf_tiles(a, b, gated: bool, slots: int = 1) -> dict:
    """dequant_gemv's rule tiles at M = 1 for each format (its TUNED table times the plain GEMV, not this one) over
    the rows of every slot: the grid has a column of programs a slot, so slots x rows is what the rule's row count
    (few rows: one a program, to fill the GPU) stands for; a fused gated pass (one format) takes half the rows. The
    H200 (tools/sweep_moe --gemv-tiles, 2026-12-04): Qwen3-30B-A3B's MoE layer at one token (8 slots of 768 x 2048
    Q4_K gate / up) 23.5 -> 19.5 us with 2 gated rows a program instead of the single one 768 rows alone gave."""
    qa, qb = a.qtype.upper(), (b.qtype if gated else a.qtype).upper()
    n = a.shape[1] * slots
    ta, tb = dg.rule_tiles(qa, 1, n), dg.rule_tiles(qb, 1, n)
    rows = max(1, ta["ROWS"] // 2) if gated and qa == qb else ta["ROWS"]
    return dict(QTYPE_A=qa, QTYPE_B=qb, ROWS=rows, STEP_A=ta["STEP"], STEP_B=tb["STEP"], PARTS_A=ta["PARTS"],
                PARTS_B=tb["PARTS"], num_warps=ta["num_warps"])


def _pass(src, a, b, dst, ids, weights, *, gated: bool, top_k: int, act: str, target: str, pdl: bool,
          block_n: int | None, block_k: int | None) -> None:
    s = ids.shape[0]
    n_rows, k_dim = a.shape[1], a.shape[2]
    common = dict(launch_pdl=pdl, TOP_K=top_k, GATED=gated, ACT=act, PDL=pdl)
    if moe_gguf.is_blocks(a):
        tiles = _gguf_tiles(a, b, gated, s)
        int8 = uses_i8(target, a, b, slots=s)
        xq, xd = i8.quantize_x(src, target=target) if int8 else (src, src)  # a plain launch (moe_qgemv_kernel's I8)
        kern = compile(moe_qgemv_kernel, target, SUBNORMAL=target in dg.SUBNORMAL_TARGETS, I8=int8, **common,
                       **tiles)
        kern[tl.cdiv(n_rows, tiles["ROWS"]), s](xq, xd, a.data, b.data, dst, ids, weights, n_rows, k_dim,
                                                elem_stride(xq, 0), elem_stride(xd, 0) if int8 else 0,
                                                elem_stride(a.data, 0), elem_stride(b.data, 0), elem_stride(dst, 0))
        return
    tiles = DENSE_TILES | {k: v for k, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k)) if v}
    kern = compile(moe_gemv_kernel, target, **common, **tiles)
    kern[tl.cdiv(n_rows, tiles["BLOCK_N"]), s](src, a, b, dst, ids, weights, n_rows, k_dim,
                                               tl.cdiv(k_dim, tiles["BLOCK_K"]), elem_stride(src, 0),
                                               elem_stride(a, 0), elem_stride(a, 1), elem_stride(dst, 0))


def run(x, weights, ids, w_gate, w_up, w_down, hidden, y, *, top_k: int, act: str, target: str, pdl: bool,
        block_n: int | None = None, block_k: int | None = None) -> None:
    """Both passes: hidden [S, I] <- the gated pass over x [T, H], y [S, H] <- the down pass, for flat weights and
    ids [S] (S = T * top_k). Raises ValueError for a GGUF stack whose rows it cannot read (stack_fits)."""
    for w, what in ((w_gate, "gate"), (w_up, "up"), (w_down, "down")):
        if not stack_fits(w):
            raise ValueError(f"{what}: the MoE GEMV needs {w.qtype} rows {dg.ALIGN.get(w.qtype.upper(), 2)}-byte "
                             "aligned (the grouped path reads any 2-byte aligned rows)")
    if moe_gguf.is_blocks(w_gate):
        x = dg.aligned_x(x)  # 16-bit x: read in 8-byte words
    tile = dict(block_n=block_n, block_k=block_k)
    _pass(x, w_gate, w_up, hidden, ids, weights, gated=True, top_k=top_k, act=act, target=target, pdl=pdl, **tile)
    _pass(hidden, w_down, w_down, y, ids, weights, gated=False, top_k=top_k, act=act, target=target, pdl=pdl, **tile)
