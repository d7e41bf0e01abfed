"""The grouped MoE over GGUF stacks at prefill sizes: experts dequantized a chunk at a time into a bounded scratch in
the activations' dtype, each chunk then through the dense grouped kernel (kernels_src/moe.py's moe_gemm_kernel).

Why: the grouped GGUF kernel (kernels_src/moe_gguf.py) decodes every weight tile in registers before each dot, once
per BLOCK_M slots, and ran at about half the dense kernel's speed on an H200 (Qwen3-30B-A3B shape, prefill 2,048:
31,266 tok/s over Q4_K_M against 60,133 over F16, docs/BENCHMARKS.md 2026-12-03). With many slots an expert, decoding
each expert once to memory (dequantize.dequantize_rows: ~90% of copy bandwidth, bound by its writes) and running the
dense tensor-core kernel on it costs a write and a read of the 16-bit stack and spares the repeated decode, as the
dense linears do above gguf_linear.GEMM_MAX_ROWS.

How, keeping a step capturable (fixed shapes, nothing read back to the host): moe_align's layout (rows, block_expert)
is computed once for the whole step. A chunk holds experts [e0, e0 + chunk); for each, one fixed-shape array op
turns the blocks of other chunks' experts into padding (their rows set to S, so their programs skip the loop and
store nothing, as padding blocks already do) and block_expert into the chunk's local index, and the dense kernel
runs on the full grid with the chunk's scratch as its stacks. Every chunk dequantizes all its experts, used or not:
at DEQUANT_SLOTS_PER_EXPERT slots an expert on average nearly every expert has slots, and skipping the others would
need the decode's grid to depend on the routing (or its programs to read a flag and exit; not worth a kernel change
for the few experts a prefill leaves empty).
"""

from __future__ import annotations

import os

import numpy as np

from kernels_src import dequantize as dq
from kernels_src import moe_gguf
from kernels_src.dsl import empty, tl

__all__ = ["DEQUANT", "DEQUANT_SLOTS_PER_EXPERT", "SCRATCH_BYTES", "WIDE_WARPS", "chunk_experts", "chunk_layout",
           "chunks", "use_dequant", "warps"]

# On by default (LLM_ENGINE_MOE_DEQUANT=0 turns it off; read once). `tools/sweep_moe --dequant` on the H200
# (2026-12-04, docs/BENCHMARKS.md; one Qwen3-30B-A3B MoE layer over Q4_K_M-like stacks, 128 experts, top 8): the
# grouped GGUF kernel against dequantize + the dense grouped one at 64 / 256 / 2,048 tokens (512 / 2,048 / 16,384
# slots): 1,145 / 1,616 / 3,586 us against 1,104 / 1,126 / 1,722 us (the dequantization alone ~602 us). Already
# ahead at 4 slots an expert, hence DEQUANT_SLOTS_PER_EXPERT = 4: every grouped step past the GEMV's
# GGUF_GEMV_SLOTS (512) at Qwen3-30B-A3B's shape takes it.
DEQUANT = os.environ.get("LLM_ENGINE_MOE_DEQUANT", "1") != "0"
# A step of at least this many slots an expert on average takes this path (see above).
DEQUANT_SLOTS_PER_EXPERT = 4
# The scratch a pass's chunk of dequantized experts may take (gate and up together, or down): Qwen3-30B-A3B's 128
# experts in fp16 are 4 chunks of 32 for gate/up (6.3 MB an expert) and 2 of 64 for down. It is held inside the step
# (and a captured prefill graph's pool), so the warm-up's peak counts it before the KV cache is sized.
SCRATCH_BYTES = 256 * 2**20

# The dense kernel's warps on this path: its gated pass at the prefill's 64 x 64 tiles (two fp32 accumulators of 64 x
# 64) spills 344 bytes a thread in the sm_90 build at 4 warps, none at 8 (test_aot_sm90_prefill_tiles). The dense
# stacks' own pass keeps 4 (timed so; untimed at 8).
WIDE_WARPS = 8


def use_dequant(slots: int, experts: int, stacks) -> bool:
    """The rule moe.moe_experts follows: on (DEQUANT), some stack GGUF blocks, and DEQUANT_SLOTS_PER_EXPERT slots an
    expert or more."""
    return DEQUANT and any(moe_gguf.is_blocks(w) for w in stacks) and slots >= DEQUANT_SLOTS_PER_EXPERT * experts


def warps(gated: bool, block_m: int, block_n: int) -> int:
    """num_warps of the dense kernel over a dequantized chunk: WIDE_WARPS for a gated pass of 64 x 64 tiles or more."""
    return WIDE_WARPS if gated and block_m * block_n >= 64 * 64 else 4


def chunk_experts(experts: int, expert_bytes: int, scratch_bytes: int) -> int:
    """Experts a chunk: as many as scratch_bytes holds (one at least), spread evenly over the fewest chunks."""
    most = max(1, scratch_bytes // expert_bytes)
    return tl.cdiv(experts, tl.cdiv(experts, most))


def chunk_layout(rows, block_expert, n_slots: int, block_m: int, chunk: int, n_chunks: int):
    """(rows [n_chunks, blocks * block_m]: moe_align's rows with the blocks of experts outside chunk i made padding
    (n_slots) in row i, block_expert [blocks] as each expert's index within its chunk), numpy or torch, no sync."""
    nblocks = block_expert.shape[0]
    owner = block_expert // chunk  # the chunk of each block's expert
    grid = rows.reshape(1, nblocks, block_m)
    if isinstance(rows, np.ndarray):
        mine = owner[None, :, None] == np.arange(n_chunks)[:, None, None]
        return (np.where(mine, grid, n_slots).astype(np.int32).reshape(n_chunks, -1),
                (block_expert % chunk).astype(np.int32))
    import torch

    mine = owner[None, :, None] == torch.arange(n_chunks, device=rows.device)[:, None, None]
    return torch.where(mine, grid, n_slots).reshape(n_chunks, -1), block_expert % chunk


def _row_ids(w, n: int):
    if isinstance(w.data, np.ndarray):
        return np.arange(n, dtype=np.int32)
    import torch

    return torch.arange(n, dtype=torch.int32, device=w.data.device)


def chunks(src, a, b, rows, block_expert, n_slots: int, *, gated: bool, block_m: int, target: str, pdl: bool,
           scratch_bytes: int | None = None):
    """For each chunk of experts, in order: dequantize its experts of a (and b when gated) into the scratch, in src's
    dtype, and yield (dense a [chunk, out, in], dense b, its rows, its block_expert) for one dense launch. The
    scratch is reused: the caller launches on the stream before asking for the next chunk."""
    e, n_cols, k_dim = a.shape
    mats = (a, b) if gated else (a,)
    item = src.itemsize if isinstance(src, np.ndarray) else src.element_size()
    chunk = chunk_experts(e, len(mats) * n_cols * k_dim * item, scratch_bytes or SCRATCH_BYTES)
    n_chunks = tl.cdiv(e, chunk)
    scratch = empty(src, (len(mats), chunk, n_cols, k_dim))
    ids = _row_ids(a, e * n_cols)
    rows_c, local = chunk_layout(rows, block_expert, n_slots, block_m, chunk, n_chunks)
    for i in range(n_chunks):
        e0, e1 = i * chunk, min(e, (i + 1) * chunk)
        for j, w in enumerate(mats):
            dq.dequantize_rows(w.data, ids[e0 * n_cols:e1 * n_cols], w.qtype, k_dim,
                               out=scratch[j, :e1 - e0].reshape((e1 - e0) * n_cols, k_dim), target=target, pdl=pdl)
        yield scratch[0], scratch[-1], rows_c[i], local
