"""The CUDA backend's eager warm-ups (graphs off): after them, no decode step of up to max_num_seqs sequences and
max_model_len tokens, nor prefill step of up to max_step_tokens, launches a kernel variant that Triton would compile
then, and they wrote nothing into the cache.

On CPU tensors (Triton's interpreter), a tiny synthetic llama. A launch's variant is what selects a compiled binary
on a GPU: the kernel, its constexprs, warps, PDL and stages, and the specialization of its arguments (dtypes,
pointers 16-byte aligned or not, integers equal to 1, multiples of 16, or neither: triton_target.direct_key, which
the direct launch path keys its binaries by). An H200 saw the steps the warm-up missed take 0.5-0.7 s to launch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import NamedTuple

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                                reason="triton/torch not installed")

SEQS, CONTEXT, BLOCK, STEP_TOKENS = 18, 256, 16, 80
# Short partitions (16 keys at one sequence's program, 32 past it), so that CONTEXT reaches 16 split-K partitions:
# the reduce's BLOCK_P up to 16, partition counts of both integer classes, two decode settings. 18 sequences: a row
# count past 16 (the GEMMs' next row bucket).
TABLE = "1:16/16x4,32/16x2,max=16"


class Variant(NamedTuple):
    kernel: str  # module.function
    constexprs: tuple
    options: tuple  # num_warps, launch_pdl, num_stages
    args: tuple  # direct_key of the launch's arguments

    def const(self, name: str):
        return dict(self.constexprs)[name]


class Variants:
    """Kernel.launch recording each launch's variant and the first step that used it. `run`: "all" launches run,
    "new" only each variant's first (Triton's interpreter builds and runs every variant once, in a fraction of the
    time), "none" (a sweep of many steps costs their host work only)."""

    def __init__(self, monkeypatch):
        from kernels_src.dsl import launch
        from kernels_src.dsl.triton_target import variant_key

        self.seen: dict[Variant, object] = {}
        self.step: object = "start-up"
        self.run = "all"
        launch_fn = launch.Kernel.launch

        def spy(kernel, grid, args):
            key = Variant(*variant_key(kernel, args))
            new = key not in self.seen
            self.seen.setdefault(key, self.step)
            return launch_fn(kernel, grid, args) if self.run == "all" or new and self.run == "new" else None

        monkeypatch.setattr(launch.Kernel, "launch", spy)

    def new(self) -> list[tuple[object, Variant]]:
        """(the step, the variant) of each variant that no start-up step launched."""
        return [(step, key) for key, step in self.seen.items() if step != "start-up"]

    def of(self, *kernels: str) -> list[Variant]:
        """The variants of the decode kernels named (paged_attention's, or paged_decode_rope's)."""
        return [v for v in self.seen if v.kernel.rsplit(".", 1)[-1] in kernels]


def arg(v: Variant, name: str):
    """The direct_key class of the variant's argument `name` (the decode kernels differ in their arguments' order)."""
    import inspect

    module, fn = v.kernel.rsplit(".", 1)
    return v.args[list(inspect.signature(getattr(importlib.import_module(module), fn)).parameters).index(name)]


def tiny_backend(monkeypatch, fused: bool = True, seqs: int = SEQS, dense_gemm: bool | None = None):
    """`dense_gemm`: the runner's switch set after the eager fusions' (which keep it unless
    LLM_ENGINE_EAGER_DENSE_GEMM=0), None: as they leave it."""
    from backends.cuda.backend import CUDABackend
    from backends.cuda.decode_table import DecodeTable
    from ir.config import ModelConfig
    from ir.loader import synthetic_model
    from ir.rope import RopeSpec

    # head_dim 16 and 32-wide rows: every stride a multiple of 16, as an 8B model's (their class never changes)
    cfg = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                      head_dim=16, num_layers=1, rms_norm_eps=1e-5, max_position_embeddings=CONTEXT,
                      rope=RopeSpec(theta=10000.0, rotary_dim=16))
    backend = CUDABackend(synthetic_model(cfg, "f16"), dtype="f16", device="cpu", cuda_graph=False, random_weights=1,
                          progress=False)
    backend.runner.decode = DecodeTable.parse(TABLE)
    # the GPU's linears of few rows: dense_gemv, built per row count (here up to 2: Triton's interpreter takes a
    # quarter second a launch), and dense_gemm from 9 rows where its table lists the problem (here every one)
    from kernels_src import dense_gemm

    monkeypatch.setattr(dense_gemm, "tuned", lambda m, n, k: {"num_warps": 4} if m >= dense_gemm.MIN_ROWS else {})
    backend.runner.dense_gemv, backend.runner.gemv_max_rows, backend.runner.dense_gemm = True, 2, True
    if fused:  # as a GPU's backend with graphs off sets it: GEMV prologues, the decode's reduce inside it
        from backends.cuda import eager

        eager.use_eager_fusions(backend.runner)
        assert backend.runner.dense_gemm == eager.DENSE_GEMM  # dense_gemm from 9 rows, its launches kept
    if dense_gemm is not None:
        backend.runner.dense_gemm = dense_gemm
    backend.set_limits(seqs, CONTEXT, STEP_TOKENS)
    backend.allocate_kv(seqs * (CONTEXT // BLOCK + 1) + 1, BLOCK)  # on CPU tensors allocate_kv warms nothing up
    return backend


def engine_step(backend, contexts, rng, extra: int = 0, prompts=()):
    """A decode step as the engine makes it (core.batch.make_batch): each sequence its own blocks (shuffled), its
    table as long as its blocks (`extra` more for the longest), a token chained from the last step; `prompts`:
    the lengths of prompts beside the decode rows, prefilled whole."""
    from core.batch import make_batch

    free = rng.permutation(backend.kv[0][0].shape[0] - 1) + 1  # block 0 is the warm-up's
    tables, at = [], 0
    for i, ctx in enumerate([*contexts, *prompts]):
        n = -(-ctx // BLOCK) + (extra if i == 0 else 0)
        tables.append(free[at:at + n].tolist())
        at += n
    chunks = [[int(t)] for t in rng.integers(0, 61, len(contexts))] + [rng.integers(0, 61, n).tolist() for n in prompts]
    batch = make_batch(chunks, [c - 1 for c in contexts] + [0] * len(prompts), tables, BLOCK)
    if contexts:
        batch.prev_rows = np.full(batch.num_tokens, -1, np.int32)
        batch.prev_rows[:len(contexts)] = np.where(rng.random(len(contexts)) < 0.5, 0, -1)
    return batch


# the start-up's launches that do not run leave their outputs unset: the interpreter warns of the NaNs after them
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fused", [True, False], ids=["eager-fusions", "graph-kernels"])
def test_no_step_compiles_after_the_eager_warm_ups(monkeypatch, fused):
    """With the eager fusions (backends/cuda/eager.py: a GPU's default with graphs off) and without them
    (LLM_ENGINE_EAGER_FUSIONS=0: the kernels graph replays launch)."""
    import torch

    from backends.cuda.warm_batches import eager_decode_steps, warm_up_eager_decode, warm_up_eager_prefill

    backend = tiny_backend(monkeypatch, fused)
    for layer in backend.kv:
        for t in layer:
            t.normal_()
    before = [t.clone() for layer in backend.kv for t in layer]
    variants = Variants(monkeypatch)
    variants.run = "new"
    warm_up_eager_decode(backend, CONTEXT)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in backend.kv for t in layer), strict=True))
    # the decode split or not, by the class of its table's stride: always 16 (a multiple of 16), an eager step's
    # tables padded to step_meta.TABLE_BUCKET blocks; decode steps rotate and write the cache inside the decode
    # (paged_decode_rope), so no plain decode kernel is built
    assert not variants.of("paged_decode_kernel", "paged_decode_fused_kernel")
    decodes = {(v.const("SPLIT"), arg(v, "bt_stride")) for v in variants.of("paged_decode_rope_kernel")}
    split = {(v.const("SPLIT"), arg(v, "bt_stride")) for v in variants.of("paged_decode_rope_fused_kernel")}
    assert decodes | split == {(False, 16), (True, 16)}
    assert not (split if not fused else {d for d in decodes if d[0]})  # a split decode: fused, or with its reduce
    # the combine by BLOCK_P and the class of the partition count: up to the grid cap of 16 partitions
    reduces = {(v.const("BLOCK_P"), arg(v, "max_parts")) for v in variants.of("paged_decode_reduce_kernel")}
    combines = {(v.const("BLOCK_P"), arg(v, "max_parts")) for v in variants.of("paged_decode_rope_fused_kernel")}
    assert (combines, reduces)[::1 if fused else -1] == ({(2, 0), (4, 0), (8, 0), (16, 0), (16, 16)}, set())
    # the GEMVs with every prologue at the rows they take (1 and 2 here): none unfused left with the eager fusions
    gemvs = {(v.const("PROLOGUE"), v.const("M")) for v in variants.seen if v.kernel.endswith(".dense_gemv_kernel")}
    assert {p for p, m in gemvs} == ({"none", "rms_norm", "add_rms_norm", "gated"} if fused else {"none"})
    assert {m for p, m in gemvs} == {1, 2}
    assert len(eager_decode_steps(backend.runner, SEQS, CONTEXT, BLOCK)) <= 40  # start-up steps

    variants.run = "all"
    rng = np.random.default_rng(0)
    # run: long contexts (split-K: 13 and 8 partitions, the reduce's BLOCK_P 16 and 8), 4 short ones (one
    # partition), 17 rows (the GEMMs' second row bucket)
    for contexts in ([200], [CONTEXT, 200], [12, 3, 9, 16], [int(c) for c in rng.integers(100, CONTEXT, 17)]):
        variants.step = tuple(contexts)
        logits = backend._forward(engine_step(backend, contexts, rng), mirror=False)
        assert logits.shape == (len(contexts), 61) and torch.isfinite(logits).all()
    assert variants.new() == [], [(s[1], v.constexprs, v.args[-9:]) for s, v in variants.new()]
    # every row count at contexts 1..CONTEXT, tables as long as the longest sequence's blocks or one more
    variants.run = "none"
    for rows in range(1, SEQS + 1):
        for ctx in [*range(1, CONTEXT, 7), CONTEXT]:
            contexts = [ctx, *rng.integers(1, ctx + 1, rows - 1).tolist()]
            variants.step = (rows, ctx)
            backend._forward(engine_step(backend, contexts, rng, extra=ctx % 2), mirror=False)
    assert variants.new() == [], [(s[1], v.constexprs, v.args[-9:]) for s, v in variants.new()]

    # prefill steps, eager at every token count with graphs off: after warm_up_eager_prefill none builds a kernel
    # either (the decode warm-up's row counts serve their row kernels up to 16 tokens)
    before = [t.clone() for layer in backend.kv for t in layer]
    variants.step, variants.run = "start-up", "new"
    warm_up_eager_prefill(backend, CONTEXT)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in backend.kv for t in layer), strict=True))
    variants.run = "all"
    for contexts, prompts in (([], [70]), ([200, 9], [5, 40])):
        variants.step = (tuple(contexts), tuple(prompts))
        logits = backend._forward(engine_step(backend, contexts, rng, prompts=prompts), mirror=False)
        assert logits.shape == (len(contexts) + len(prompts), 61) and torch.isfinite(logits).all()
    variants.run = "none"
    for tokens in range(2, STEP_TOKENS + 1):
        for _ in range(3):  # one prompt or up to three, beside decode rows (up to SEQS - 3, within STEP_TOKENS)
            cuts = sorted(rng.choice(np.arange(1, tokens), int(rng.integers(0, min(3, tokens))), replace=False))
            prompts = np.diff([0, *cuts, tokens]).tolist()  # `tokens` prompt tokens in all
            rows = int(rng.integers(0, min(SEQS - 3, STEP_TOKENS - tokens) + 1))
            contexts = rng.integers(1, CONTEXT - tokens, rows).tolist()
            variants.step = (tuple(contexts), tuple(prompts))
            backend._forward(engine_step(backend, contexts, rng, extra=tokens % 2, prompts=prompts), mirror=False)
    assert variants.new() == [], [(s[1], v.constexprs, v.args[-9:]) for s, v in variants.new()]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_few_sequences_prefill_every_small_prompt_at_start_up(monkeypatch):
    """With fewer than 16 sequences no decode step has 5..16 rows, yet a prompt of that many tokens runs its linears
    at that many rows (here the dense GEMM from 9, built per row count's class and tile): the prefill warm-up runs
    those counts itself (a 16-token prompt built a GEMM at its first request before)."""
    backend = tiny_backend(monkeypatch, seqs=4, dense_gemm=True)  # LLM_ENGINE_EAGER_FUSIONS=0's, or a prefill's
    from backends.cuda.warm_batches import warm_up_eager_decode, warm_up_eager_prefill

    variants = Variants(monkeypatch)
    variants.run = "new"
    warm_up_eager_decode(backend, CONTEXT)
    warm_up_eager_prefill(backend, CONTEXT)
    assert any(v.kernel.endswith(".dense_gemm_kernel") for v in variants.seen)
    rng = np.random.default_rng(1)
    variants.run = "none"
    for tokens in range(1, 33):
        for rows in (0, 3):  # alone, and beside three decode rows
            variants.step = (rows, tokens)
            backend._forward(engine_step(backend, rng.integers(1, 100, rows).tolist(), rng, prompts=[tokens]),
                             mirror=False)
    assert variants.new() == [], [(s, v.kernel, v.constexprs) for s, v in variants.new()]
