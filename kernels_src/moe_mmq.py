"""The fused MoE's two grouped passes on int8 tensor cores over Q4_K / Q6_K expert stacks (llama.cpp's MMQ for
MoE): DSL kernel, its launch, the rule that takes it.

The grouped GGUF kernel (kernels_src/moe_gguf.py) decodes every weight element to fp16 before its MMA (an H200 at
~12% of its roofline on Qwen3-30B-A3B's layer), and moe_dequant.py writes the whole stack out in fp16 first (1.2 GB
a layer, ~602 us of the ~1,104). Here the quants stay integers, as in the dense MMQ (kernels_src/gguf_mmq_sb.py,
variant per256): x is quantized to int8 with one scale a super-block (quantize_x256, a launch before each pass: x
[T, H] before the gated one, h [S, I] before the down one), and each super-block's int8 MMAs add up in int32 with
the quants' scales, fp32 entered once a super-block. The per-super-block arithmetic is gguf_mmq_sb's own
(q4k_super_block / q6k_super_block), called here on gathered x rows instead of a dense tile.
- Grid and grouping as moe.py's: moe_align's rows / block_expert, program (block b, column tile j) owns expert
  block_expert[b]'s BLOCK_M slots and W rows e * n_cols + j * BLOCK_N.. (clamped at the expert's n_cols: read
  again, never stored). Its x rows are gathered: a slot's token's row of xq in the gated pass (slot // TOP_K), the
  slot's own row of h's quantization in the down pass. A block of padding only skips its loop.
- GATED: gate and up (each Q4_K or Q6_K) walk K in one loop, two accumulators; h = act(gate) * up, in x's dtype.
  Down: acc * the slot's routing weight into y [S, H]; moe.py sums each token's top_k rows.
- SWAP orientation as the dense MMQ: W rows are the MMA's M side (BLOCK_N), the slots its N (BLOCK_M).
- K must be whole super-blocks (2048 and 768 are); no split-K (3-8 super-blocks a pass at Qwen3-30B-A3B).
Accuracy: x and h move by their int8 quantization, one step max|v| / 127 a 256 elements (int8_error_bound(..,
group=256) a pass).
"""

from __future__ import annotations

import os

import numpy as np

from kernels_src import gguf_mmq, moe_gguf
from kernels_src import gguf_mmq_sb as sb
from kernels_src.dsl import compile, elem_stride, tl
from kernels_src.dsl.interpreter import round_bf16
from kernels_src.moe_slots import block_slots, swapped_block_out

__all__ = ["BLOCK_M", "MMQ", "MMQ_MIN_SLOTS", "MMQ_QTYPES", "MMQ_SLOTS_PER_EXPERT", "TILES", "launch",
           "moe_mmq_kernel", "moe_mmq_ref", "over_gemv", "pass_tiles", "takes", "use_mmq"]

# On since the H200's sweep (`tools/sweep_moe --variants blocked,mmq --tokens 16-256 --layers 4`, 2026-12-05, a
# Qwen3-30B-A3B Q4_K_M layer): at 128 tokens (1,024 slots) 645 us against the GEMV's 1,127 and dequantize + dense's
# 1,060; at 256, 932 against 1,129 and 2,239. LLM_ENGINE_MOE_MMQ=0 turns it off (read once).
MMQ = os.environ.get("LLM_ENGINE_MOE_MMQ", "1") == "1"
MMQ_QTYPES = ("Q4_K", "Q6_K")
# Below this many slots an expert on average a grouped step takes this path (when on); above it dequantizing each
# expert once and the dense tensor-core kernel (moe_dequant.py) wins. The sweep: mmq's share of dequant's time grew
# 0.61 -> 0.83 from 1,024 to 2,048 slots over 128 experts (mmq +287 us, dequant +69 per 1,024 slots): they meet near
# 2,980 slots, ~23 an expert.
MMQ_SLOTS_PER_EXPERT = 24
# With MMQ on, a step of this many slots or more whose gate / up pass this path takes runs grouped here instead of
# as the GEMV a slot (moe_gemv, up to its GGUF_GEMV_SLOTS). The sweep: at 256 slots the GEMV 294 us against mmq's
# 516; at 512 slots 572 against 530 (at TILES' 32 x 4 warps); the GEMV grows ~1.1 us a slot and mmq little below
# 1,024. LLM_ENGINE_MOE_MMQ_MIN_SLOTS=N (read once) moves it.
MMQ_MIN_SLOTS = int(os.environ.get("LLM_ENGINE_MOE_MMQ_MIN_SLOTS", "512"))
# A decode batch has 1-8 slots an expert: 16-slot blocks (the MMA's N; Q4_K's minimums by FFMA below
# gguf_mmq_sb.MMA_MINS_ROWS).
BLOCK_M = 16
# (BLOCK_N, num_warps) at BLOCK_M 16 by whether a pass reads Q6_K. The H200's sweep at 64 tokens (both passes alike,
# a Qwen3-30B-A3B Q4_K_M layer): 32 x 4 warps 530 us, 128 x 8 567, the earlier rule's 64 x 4 (Q4_K) / 64 x 8 (Q6_K)
# 595, 64 x 8 834. sm_90 builds (tests/test_kernels_moe_mmq.py::test_aot_sm90) spill nothing at 32 x 4; Q6_K at 4
# warps spills from 64 wide.
TILES = {False: (32, 4), True: (32, 4)}


def moe_mmq_kernel(xq, xd, xs, w_a, w_b, y, rows, block_expert, weights, n_slots, n_cols, n_steps, xq_stride,
                   xd_stride, xs_stride, a_stride, b_stride, y_stride, TOP_K: tl.constexpr, GATED: tl.constexpr,
                   ACT: tl.constexpr, QTYPE_A: tl.constexpr, QTYPE_B: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PDL: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 0):
    """Program (b, j): slots rows[b * BLOCK_M ..] (all of expert block_expert[b]), columns BLOCK_N j.. of y, on
    quantize_x256's (xq, xd, xs) of the pass's input. GATED: y = act(x[tok] @ A[e].T) * (x[tok] @ B[e].T), tok =
    slot // TOP_K; else y = (x[slot] @ A[e].T) * weights[slot]. A, B: Q4_K / Q6_K stacks of n_cols rows an expert,
    n_steps super-blocks a row. The accumulators are [BLOCK_N, BLOCK_M] (W @ x.T). LOOP_STAGES: the K loop
    software-pipelined (gguf_mmq.LOOP_STAGES)."""
    if PDL:  # x's quantization comes from the launch before, the routing from earlier ones
        tl.wait_prior_grid()
        tl.launch_dependents()
    e, slot, valid, src, n = block_slots(rows, block_expert, n_slots, TOP_K, GATED, BLOCK_M, BLOCK_N)
    row = e * n_cols + tl.minimum(n, n_cols - 1).to(tl.int64)  # past the expert's rows: its last, not stored
    xsrc = src.to(tl.int64)
    xrow = xq + xsrc[None, :] * xq_stride + tl.arange(0, 32)[:, None]  # K-major [32, BLOCK_M], gathered
    drow, srow = xd + xsrc * xd_stride, xs + xsrc * xs_stride
    term_a, size_a = sb.SUPER_BLOCKS[QTYPE_A]
    term_b, size_b = sb.SUPER_BLOCKS[QTYPE_B]
    wa, wb = w_a + row * a_stride, w_b + row * b_stride

    def step(s, *accs):
        acc_a = accs[0] + term_a(wa + s * size_a, xrow, srow, drow, s, BLOCK_M, BLOCK_N)
        if not GATED:
            return acc_a
        return acc_a, accs[1] + term_b(wb + s * size_b, xrow, srow, drow, s, BLOCK_M, BLOCK_N)

    swapped_block_out(step, rows, n_slots, n_steps, weights, y, slot, valid, src, n, n_cols, y_stride, GATED, ACT,
                      BLOCK_M, BLOCK_N, LOOP_STAGES)


# --- host side -------------------------------------------------------------------------------------------------

def use_mmq(slots: int, experts: int) -> bool:
    """The rule moe.moe_experts follows for a grouped step (past the GEMV's bound): on (MMQ) and fewer than
    MMQ_SLOTS_PER_EXPERT slots an expert on average; each pass then goes here if `takes` it."""
    return MMQ and slots < MMQ_SLOTS_PER_EXPERT * experts


def over_gemv(slots: int, w_gate, w_up, k_dim: int) -> bool:
    """Whether a step the GEMV path would take runs grouped here instead: on (MMQ), MMQ_MIN_SLOTS slots or more, and
    gate and up stacks this path takes (the down pass goes here too where it can, else the grouped GGUF kernel)."""
    return MMQ and slots >= MMQ_MIN_SLOTS and takes(w_gate, w_up, True, k_dim)


def takes(a, b, gated: bool, k_dim: int) -> bool:
    """Whether a pass over stacks a (and b when gated) can run here: GGUF blocks of MMQ_QTYPES, K whole
    super-blocks, Q4_K rows 4-byte aligned (its headers are read as words)."""
    stacks = (a, b) if gated else (a,)
    if not all(moe_gguf.is_blocks(w) and w.qtype.upper() in MMQ_QTYPES for w in stacks) or k_dim % sb.GROUP:
        return False
    return moe_gguf.whole_words(*(w for w in stacks if w.qtype.upper() == "Q4_K"))


def pass_tiles(gated: bool, block_m: int, qtypes=("Q4_K",)) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a pass over stacks of qtypes at block_m slots a block: TILES (at BLOCK_M 16; taller
    blocks narrow BLOCK_N, keeping the accumulators' size)."""
    block_n, warps = TILES["Q6_K" in [q.upper() for q in qtypes]]
    return max(16, block_n * BLOCK_M // max(block_m, BLOCK_M)), warps


def launch(src, a, b, dst, rows, block_expert, weights, n_slots: int, *, gated: bool, top_k: int, act: str,
           block_m: int, target: str, pdl: bool, block_n: int | None = None, num_warps: int | None = None,
           loop_stages: int | None = None) -> None:
    """One pass of the fused MoE over Q4_K / Q6_K stacks a (and b when gated; `takes` says which): src quantized
    by quantize_x256, then dst [S, n_cols] by slot. loop_stages: the K loop pipelined (None: gguf_mmq.LOOP_STAGES)."""
    if not gated:
        b = a
    k_dim = src.shape[1]
    if not takes(a, b, gated, k_dim):
        raise ValueError(f"moe_mmq: {a.qtype} / {b.qtype} stacks over K = {k_dim} are not Q4_K / Q6_K blocks of "
                         f"whole super-blocks ({sb.GROUP}) with Q4_K rows 4-byte aligned")
    qa, qb = a.qtype.upper(), b.qtype.upper()
    split = "Q4_K" in (qa, qb) and block_m >= sb.MMA_MINS_ROWS  # Q4_K's minimums by MMA: split sums
    x = src if elem_stride(src, 1) == 1 else src.contiguous()
    xq, xd, xs = sb.quantize_x256(x, target, split=split)
    tile_n, warps = pass_tiles(gated, block_m, (qa, qb))
    block_n, num_warps = block_n or tile_n, num_warps or warps
    n_cols = a.shape[1]
    kern = compile(moe_mmq_kernel, target, num_warps=num_warps, launch_pdl=pdl, TOP_K=top_k, GATED=gated, ACT=act,
                   QTYPE_A=qa, QTYPE_B=qb, BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl,
                   LOOP_STAGES=gguf_mmq.loop_stages(loop_stages))
    kern[block_expert.shape[0], tl.cdiv(n_cols, block_n)](
        xq, xd, xs, a.data, b.data, dst, rows, block_expert, weights, n_slots, n_cols, k_dim // sb.GROUP,
        elem_stride(xq, 0), elem_stride(xd, 0), elem_stride(xs, 0), elem_stride(a.data, 0), elem_stride(b.data, 0),
        elem_stride(dst, 0))


def _rounded(v: np.ndarray, dtype: str) -> np.ndarray:
    """v rounded to the activations' dtype (float32, float16, bfloat16: to nearest even) and back, fp32."""
    v = np.asarray(v, np.float32)
    if dtype == "float16":
        return v.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return round_bf16(v)
    return v


def moe_mmq_ref(x, weights, ids, w_gate, w_up, w_down, act: str = "silu", h_dtype: str = "float32") -> np.ndarray:
    """What moe.moe_experts(mmq=True) computes over Q4_K / Q6_K stacks, in float64, slot by slot: x and h quantized
    as quantize_x256 does (gguf_mmq_sb.quantize_x256_ref; h first rounded to h_dtype, the activations' dtype, as
    the gated pass stores it), the stacks decoded by our numpy dequantizer."""
    from ir.interpreter import KERNELS

    def q256(v):
        q, d = sb.quantize_x256_ref(np.asarray(v, np.float32))
        return (q.reshape(q.shape[0], -1, sb.GROUP).astype(np.float64) * d[..., None]).reshape(q.shape)

    gate, up, down = (moe_gguf.dequantize_stack(w).astype(np.float64) for w in (w_gate, w_up, w_down))
    ids = np.asarray(ids)
    xq, top_k = q256(x), ids.shape[1]
    h = np.stack([KERNELS[act](gate[e] @ xq[s // top_k]) * (up[e] @ xq[s // top_k])
                  for s, e in enumerate(ids.reshape(-1))])
    hq = q256(_rounded(h, h_dtype))
    y = np.stack([down[e] @ hq[s] for s, e in enumerate(ids.reshape(-1))])
    y *= np.asarray(weights, np.float64).reshape(-1, 1)
    return y.reshape(ids.shape[0], top_k, -1).sum(1)
