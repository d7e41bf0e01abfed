"""The MoE's GGUF passes as a grouped GEMV, for decode batches of ~16-128 tokens (128-1,024 slots at top 8): the DSL
kernel and its launch; the reference is moe.moe_experts_ref.

moe_gemv's per-slot GEMV streams an expert's blocks once for every slot routed to it: at 512 slots over 128 experts
~4 slots an expert, so ~4x the expert bytes. The grouped GGUF kernel (moe_gguf) reads them once but decodes tiles for
tensor cores at ~280 GB/s on an H200. Here the slots are aligned by expert first (moe.moe_align, blocks of M slots of
one expert padded with S), and program (row tile j, block b) decodes its ROWS rows of expert block_expert[b] once per
K step and dots them with the block's up to M rows of x, through dequant_gemv's `_gemv_loop` at M (it carries M x
rows and M accumulators a row), so the per-format decode stays in dequant_gemv. A block of M slots reads its expert
once: at 512 random slots over 128 experts ~1.3x the expert bytes instead of ~4x.
- gated pass: h[s] = weights[s] * act(gate[e] @ x[s // TOP_K]) * (up[e] @ x[s // TOP_K]), gate and up of one
  format sharing each step's x (half of the rule's rows each, as moe_gemv); of two formats, two loops.
- down pass: y[s] = down[e] @ h[s]; moe.py sums each token's top_k rows.
Padding slots (id S) read a real row of x (clamped: no address outside it) and store nothing; a block whose first
slot is padding (a block past the used ones, or of an empty expert's run) runs no K step. Dense passes (a stack that
is not GGUF) go through moe_gemv's per-slot pass. Tiles from dequant_gemv's rule at M.
On int8 x (I8: as moe_gemv.uses_i8 decides for the per-slot GEMV, Q4_K / Q5_K / Q6_K passes on Triton) a pass runs
quantize_x over its input first and the kernel reads codes and per-32 scales through dequant_gemv_i8's loads and dp4a
dots, as moe_qgemv_kernel's I8 does; quantize_x is a plain launch, so under PDL a program waits only before its
first x load (the alignment's array ops ran before quantize_x).
"""

from __future__ import annotations

from kernels_src import dequant_gemv as dg
from kernels_src import dequant_gemv_i8 as i8
from kernels_src import moe_gemv, moe_gguf
from kernels_src.activations import _act
from kernels_src.dsl import compile, elem_stride, tl
from kernels_src.gguf_gemv_common import _Decode

__all__ = ["M", "moe_grouped_qgemv_kernel", "run", "tiles"]

M = 8  # slots a block (moe_align's block_m): the x rows each program dots its decoded rows with


def moe_grouped_qgemv_kernel(x, xd, w_a, w_b, y, rows, block_expert, weights, n_slots, n_rows, n_cols, x_stride,
                             xd_stride, a_stride, b_stride, y_stride, TOP_K: tl.constexpr, GATED: tl.constexpr,
                             ACT: tl.constexpr, QTYPE_A: tl.constexpr, QTYPE_B: tl.constexpr, M: tl.constexpr,
                             ROWS: tl.constexpr, STEP_A: tl.constexpr, STEP_B: tl.constexpr, PARTS_A: tl.constexpr,
                             PARTS_B: tl.constexpr, SUBNORMAL: tl.constexpr, PDL: tl.constexpr = False,
                             I8: tl.constexpr = False):
    """Program (j, b): rows ROWS j.. of expert block_expert[b] (GGUF blocks [E * n_rows, row bytes]; a_stride,
    b_stride: row strides in bytes) for the slots rows[b * M ..] (n_slots: padding). GATED: y[s] = weights[s] *
    act(w_a[e] @ x[s // TOP_K]) * (w_b[e] @ x[s // TOP_K]); else y[s] = w_a[e] @ x[s]. I8: x is quantize_x's int8
    q and xd its per-32 scales (row stride xd_stride; unused otherwise)."""
    if PDL and not I8:  # the alignment (which says what to read), x and the weights come from earlier kernels
        tl.wait_prior_grid()
        tl.launch_dependents()
    blk = tl.program_id(1)
    first = tl.load(block_expert + blk).to(tl.int64) * n_rows  # the expert's first row
    slots = [tl.load(rows + blk * M + m) for m in range(M)]
    # a block's real slots come first: one of padding only runs no K step (n_blk = 0 in the loop)
    k_cols = tl.where(slots[0] < n_slots, n_cols, 0)
    clamped = [tl.minimum(s, n_slots - 1) for s in slots]  # padding reads the last slot's row, stores nothing
    src = [(c // TOP_K if GATED else c).to(tl.int64) for c in clamped]
    xrows, xdrows = [x + r * x_stride for r in src], [xd + r * xd_stride for r in src]
    dec = _Decode(SUBNORMAL)

    def x_i8(m, b, x_load):
        if PDL and m == 0:  # after the step's weight loads: quantize_x, before this kernel, wrote x
            tl.wait_prior_grid()
        return x_load(xrows[m], xdrows[m], b)

    def sums(mats, QTYPE, STEP, PARTS):
        return moe_gemv.gguf_pass_sums(mats, QTYPE, STEP, PARTS, first, n_rows, k_cols, M, ROWS, I8,
                                       lambda m: xrows[m], x_i8, dec)

    if not GATED:
        out_rows, out = sums([(w_a, a_stride)], QTYPE_A, STEP_A, PARTS_A)
    else:
        out_rows, both = moe_gemv.gate_up_sums(sums, (w_a, a_stride), (w_b, b_stride), QTYPE_A, QTYPE_B,
                                               (STEP_A, PARTS_A), (STEP_B, PARTS_B))
        w_slot = [tl.load(weights + c).to(tl.float32) for c in clamped]
        half = ROWS * M
        out = [_act(both[i], ACT) * both[half + i] * w_slot[i % M] for i in range(half)]
    if PDL and I8:  # a program whose loop ran no step has not waited yet (a later wait returns at once)
        tl.wait_prior_grid()
        tl.launch_dependents()
    for r, row in enumerate(out_rows):
        for m in range(M):
            tl.store(y + clamped[m].to(tl.int64) * y_stride + row, out[r * M + m],
                     mask=(row < n_rows) & (slots[m] < n_slots))


# --- host side -------------------------------------------------------------------------------------------------

def tiles(a, b, gated: bool, m: int = M) -> dict:
    """moe_gemv's tiles of a GGUF pass (dequant_gemv's rule) at M = m, with M."""
    return moe_gemv._gguf_tiles(a, b, gated, m) | {"M": m}


def _pass(src, a, b, dst, rows, block_expert, ids, weights, *, gated: bool, top_k: int, act: str, target: str,
          pdl: bool, m: int) -> None:
    if not moe_gguf.is_blocks(a):  # a dense pass: moe_gemv's, a GEMV a slot
        moe_gemv._pass(src, a, b, dst, ids, weights, gated=gated, top_k=top_k, act=act, target=target, pdl=pdl,
                       block_n=None, block_k=None)
        return
    t = tiles(a, b, gated, m)
    int8 = moe_gemv.uses_i8(target, a, b, slots=ids.shape[0])
    xq, xd = i8.quantize_x(src, target=target) if int8 else (src, src)  # a plain launch (the kernel's I8)
    kern = compile(moe_grouped_qgemv_kernel, target, num_warps=t.pop("num_warps"), launch_pdl=pdl, TOP_K=top_k,
                   GATED=gated, ACT=act, SUBNORMAL=target in dg.SUBNORMAL_TARGETS, PDL=pdl, I8=int8, **t)
    n_rows, k_dim = a.shape[1], a.shape[2]
    kern[tl.cdiv(n_rows, t["ROWS"]), block_expert.shape[0]](
        xq, xd, a.data, b.data, dst, rows, block_expert, weights, ids.shape[0], n_rows, k_dim, elem_stride(xq, 0),
        elem_stride(xd, 0) if int8 else 0, elem_stride(a.data, 0), elem_stride(b.data, 0), elem_stride(dst, 0))


def run(x, weights, ids, rows, block_expert, w_gate, w_up, w_down, hidden, y, *, top_k: int, act: str, target: str,
        pdl: bool, m: int = M) -> None:
    """Both passes: hidden [S, I] <- the gated pass over x [T, H], y [S, H] <- the down pass, for flat weights and
    ids [S] and moe_align's (rows, block_expert) at block_m = m. Raises ValueError for a GGUF stack whose rows the
    loads cannot read (moe_gemv.stack_fits)."""
    x = moe_gemv.readable_x(x, w_gate, w_up, w_down, "the grouped MoE GEMV")
    common = dict(top_k=top_k, act=act, target=target, pdl=pdl, m=m)
    _pass(x, w_gate, w_up, hidden, rows, block_expert, ids, weights, gated=True, **common)
    _pass(hidden, w_down, w_down, y, rows, block_expert, ids, weights, gated=False, **common)
