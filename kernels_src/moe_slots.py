"""Where a fused-MoE program starts, over moe_align's layout (kernels_src/moe.py): the dense kernel and the GGUF one
(kernels_src/moe_gguf.py) begin the same way, and this is that beginning, once."""

from __future__ import annotations

from kernels_src.dsl import tl


def block_slots(rows, block_expert, n_slots, TOP_K, GATED, BLOCK_M, BLOCK_N):
    """Program (b, j)'s expert, its BLOCK_M slots (`valid`: the real ones), the rows of x they read (a token's when
    gated; else the slot's own row of h) and its BLOCK_N output columns."""
    e = tl.load(block_expert + tl.program_id(0)).to(tl.int64)
    slot = tl.load(rows + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slot < n_slots
    src = tl.where(valid, slot // TOP_K if GATED else slot, 0)
    return e, slot, valid, src, tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
