"""What a backend built with CUDA graphs off fuses that a graph replay does not (issue 13: eager within 1.5x of
graphs).

An eager decode step is host-bound: on an H200 host a DSL launch costs ~18 us, a Llama-3-8B layer ~155 us of GPU time
against ~466 us of host time (docs/BENCHMARKS.md, 2026-12-04 late), so the GPU waits between launches. Work that trades
GPU time for fewer launches is then a win even where it loses under graphs:
- the dense GEMV's prologues (backends/cuda/gemv_fusion.py: rms_norm / add_rms_norm -> qkv and gate_up, gated ->
  down): 3 launches fewer a layer at one row. Under graphs they lost ~10% of the GPU time of a one-row step (gate_up's
  fused norm; docs/BENCHMARKS.md 2026-12-03 afternoon), hence Runner.gemv_prologues' False there;
- the split-K decode's partials combined by its last program (kernels_src/decode_combine.py): no reduce launch at
  contexts long enough to split (4k at batch 1). Under graphs it saved nothing (PDL already overlapped the reduce).
And a decode step's intermediates live in buffers kept between steps (backends/cuda/step_arena.py), as a graph's
static buffers do: no torch.empty (~7 us of host time each) for them.

Decided per backend, not per step: with graphs on every decode step of up to max_num_seqs sequences replays a graph
(DecodeGraphs.applies: a graph for each batch bucket, tables as wide as the longest context), so the steps left eager
there are prefill and mixed steps past the pieces, whose rows exceed the one the GEMV takes; switching per step would
only add prologue variants to the graphs-on warm-up for steps that never come. With graphs off, start-up's eager
warm-up (warm_batches.warm_up_eager_decode) runs the runner as it is set here, so it builds the fused variants.
"""

from __future__ import annotations

import os

from backends.cuda.graphs import BATCH_BUCKETS
from backends.cuda.step_arena import StepArena
from core.batch import Batch, pad_decode
from kernels_src.decode_combine import FUSED_REFUSED, FUSED_TARGETS

ENV = "LLM_ENGINE_EAGER_FUSIONS"  # "0": eager steps launch the kernels graph replays launch
DEFAULT = os.environ.get(ENV, "1") != "0"
ARENA_ENV = "LLM_ENGINE_STEP_ARENA"  # "0": with the fusions on, a decode step's intermediates allocated each step
ARENA = os.environ.get(ARENA_ENV, "1") != "0"
DENSE_GEMM_ENV = "LLM_ENGINE_EAGER_DENSE_GEMM"  # "0": an eager step's 9+ row linears on cuBLAS, not dense_gemm
DENSE_GEMM = os.environ.get(DENSE_GEMM_ENV, "1") != "0"
PAD_ROWS_ENV = "LLM_ENGINE_EAGER_PAD_ROWS"  # "0": an eager decode step runs its own row count
PAD_ROWS = os.environ.get(PAD_ROWS_ENV, "1") != "0"


def use_eager_fusions(runner) -> None:
    """Set `runner` (a backend's with graphs off) to fuse for launches: GEMV prologues at one row, and the decode's
    reduce inside the decode where the target has atomics (Triton's, and the DSL's interpreter); and to keep a decode
    step's intermediates between steps, and the launches of its GEMVs and GEMMs."""
    runner.gemv_prologues = True
    # dense_gemm where its table lists the problem, as under graphs, its launches kept for the step's arrays
    # (dense_gemm.launched: two C launches a linear, the split-K partials kept); without them a call of it cost ~4x
    # torch.mm's host time (an H100 profile, 2026-12-05, tools/bench_launch --batch 16: its 3 calls a layer held 119
    # of the 244 ms profiled over 32 eager steps), hence cuBLAS in eager steps before. LLM_ENGINE_EAGER_DENSE_GEMM=0:
    # cuBLAS (the A/B)
    runner.dense_gemm = runner.dense_gemm and DENSE_GEMM
    runner.arena = StepArena(runner.graph) if ARENA else None
    # (LLM_ENGINE_FUSED_REDUCE=0 said outright keeps the reduce kernel here too: the A/B of eager decode at 4k)
    if runner.target in (*FUSED_TARGETS, "numpy") and not FUSED_REFUSED:
        runner.fused_reduce = True


def padded_rows(batch: Batch, max_seqs: int) -> Batch:
    """An eager decode step with its rows rounded up to a graph's batch bucket (at most max_seqs), as a replay pads
    them. The step arena keeps its buffers and launches for one row count, and a batch that shrinks a sequence at a
    time (requests finishing) made each step plan every launch again: on an H100 (session 18) such steps at a 4k
    context took 13-21 ms where the 16-row ones took 9.5. The padding rows cost little GPU time at these row counts
    (the weights' reads dominate; their attention reads nothing)."""
    return pad_decode(batch, step_rows(batch.num_tokens, max_seqs))


def pads_rows(runner) -> bool:
    """Whether `runner`'s eager decode steps run padded rows (padded_rows): with its step arena, unless switched off."""
    return runner.arena is not None and PAD_ROWS


def step_rows(n: int, max_seqs: int) -> int:
    """The rows a padded eager decode step of n sequences runs: n's batch bucket, at most max_seqs (or n)."""
    return min(next((b for b in BATCH_BUCKETS if b >= n), n), max(n, max_seqs))
