"""Where a fused-MoE program starts, over moe_align's layout (kernels_src/moe.py): the dense kernel and the GGUF ones
(kernels_src/moe_gguf.py, moe_mmq.py) begin the same way, and this is that beginning, once; the GGUF ones, whose
accumulators are W @ x.T, also end the same way (swapped_block_out)."""

from __future__ import annotations

from kernels_src.activations import _act
from kernels_src.dsl import tl


def block_slots(rows, block_expert, n_slots, TOP_K, GATED, BLOCK_M, BLOCK_N):
    """Program (b, j)'s expert, its BLOCK_M slots (`valid`: the real ones), the rows of x they read (a token's when
    gated; else the slot's own row of h) and its BLOCK_N output columns."""
    e = tl.load(block_expert + tl.program_id(0)).to(tl.int64)
    slot = tl.load(rows + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slot < n_slots
    src = tl.where(valid, slot // TOP_K if GATED else slot, 0)
    return e, slot, valid, src, tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)


def swapped_block_out(step, rows, n_slots, n_steps, weights, y, slot, valid, src, n, n_cols, y_stride, GATED, ACT,
                      BLOCK_M, BLOCK_N, LOOP_STAGES: int = 0):
    """The end of a program whose accumulators are [BLOCK_N, BLOCK_M] (W @ x.T: moe_gguf's and moe_mmq's): the K loop
    (`step(it, *accs)`: two accumulators when GATED; LOOP_STAGES: software-pipelined, gguf_mmq.LOOP_STAGES), then
    y = act(gate) * up (GATED) or acc * the slot's routing weight, stored by slot."""
    zero = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    # a block of padding only (most of the grid at small batches) skips the loop instead of streaming weights
    steps = tl.where(tl.load(rows + tl.program_id(0) * BLOCK_M) < n_slots, n_steps, 0)
    if GATED:
        acc_a, acc_b = tl.fori_loop(0, steps, step, (zero, zero), stages=LOOP_STAGES)
        out = _act(acc_a, ACT) * acc_b
    else:
        acc_a = tl.fori_loop(0, steps, step, zero, stages=LOOP_STAGES)
        out = acc_a * tl.load(weights + src, mask=valid, other=0.0).to(tl.float32)[None, :]
    tl.store(y + slot.to(tl.int64)[None, :] * y_stride + n[:, None], out, mask=valid[None, :] & (n[:, None] < n_cols))
