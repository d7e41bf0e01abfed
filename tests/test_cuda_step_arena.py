"""An eager decode step's kept buffers (backends/cuda/step_arena.py): steps with them give the logits of steps
without, bit for bit, over several steps of one batch and of another, with every kept buffer filled with NaN before
each step (a value read after its producer's next step began would read NaN); and a planted escape (a graph output
let into the arena) is seen: the logits a step returned change under the next step.

The tiny synthetic llama of tests/test_cuda_eager_fusions.py on CPU tensors, its kernels on the DSL's interpreter."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.test_cuda_eager_fusions import _backend, _step, launches  # noqa: F401  (launches: a fixture)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")

# one row, two rows, one row again: the arena starts over; at 49 and 65 tokens the tables widen and at 65 the decode
# takes a third 32-token partition: its launches are made again
STEPS = ([40], [41], [42], [49], [65], [90, 37], [91, 38], [43])


def _run(backend, arena) -> list[np.ndarray]:
    """The logits of STEPS, each as returned (a tensor held while later steps run) and as copied then; then of a
    step after a parameter of each layer is replaced (a new tensor: a launch kept for the old one is not reused)."""
    from backends.cuda import eager

    eager.use_eager_fusions(backend.runner)
    backend.runner.arena = arena
    held, copies = [], []
    for contexts in STEPS:
        held.append(backend.forward(_step(contexts)))
        copies.append(held[-1].numpy().copy())
    params = backend.runner.params
    for name in [n for n in params if n.endswith((".wo", ".w_down"))]:
        params[name] = params[name] * 1.5
    held.append(backend.forward(_step(STEPS[-1])))
    copies.append(held[-1].numpy().copy())
    return held, copies


def test_kept_buffers_give_the_same_logits(launches, monkeypatch):  # noqa: F811
    from backends.cuda import attention, step_meta
    from backends.cuda.step_arena import StepArena
    from kernels_src import dense_gemv as dg

    _, want = _run(_backend(), None)
    backend = _backend()
    arena = StepArena(backend.runner.graph, check=True)
    held, got = _run(backend, arena)
    for w, g, h in zip(want, got, held, strict=True):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(h.numpy(), w)  # what a step returned is not a kept buffer
    # the last step (one row) kept its values: a layer's 4 GEMVs, 2 add_rms_norm sums (layer 0's first norm has
    # none) and the attention's output, the final add_rms_norm's sum and norm; not the logits
    layers = backend.model.config.num_layers
    assert arena.rows == 1 and len(arena._buffers) == 7 * layers + 1, len(arena._buffers)
    ptrs = {vid: b.data_ptr() for vid, b in arena._buffers.items()}
    backend.forward(_step([44]))
    assert {vid: b.data_ptr() for vid, b in arena._buffers.items()} == ptrs  # the same buffers again
    # and their launches again, kept (step_arena.memo): no plan looked up but for layer 0's qkv and gate_up (they
    # read the embedding's rows, a new tensor each step) and the logits' (a graph output, not kept)
    assert not np.array_equal(got[-1], got[-2])  # the replaced parameters were read
    # the attention's too (a token longer: the same tables and partitions)
    looked, real, attended = [], dg._planned, []
    monkeypatch.setattr(dg, "_planned", lambda *a: looked.append(1) or real(*a))
    real_attention = attention._attention
    monkeypatch.setattr(attention, "_attention", lambda *a: attended.append(1) or real_attention(*a))
    launches.clear()
    backend.forward(_step([45]))
    assert launches["dense_gemv_kernel"] == 4 * layers + 1 and len(looked) == 3, (launches, looked)
    # (the rope and cache write inside the decode: kernels_src/paged_decode_rope.py)
    assert launches["paged_decode_rope_fused_kernel"] == layers and not launches["rope_kv_write_kernel"]
    assert not attended
    # a block more in the table (49 tokens): padded to the same width (step_meta.TABLE_BUCKET), still kept
    backend.forward(_step([49]))
    assert not attended
    monkeypatch.setattr(step_meta, "TABLE_BUCKET", 1)  # as before the padding: the table's shape changes
    backend.forward(_step([50]))
    assert len(attended) == layers


def test_planted_escape_is_seen(launches, monkeypatch):  # noqa: F811
    """With no value kept out (the logits too in the arena) the logits a step returned are overwritten by the next
    step's: what kept_values prevents, and what the check above would see."""
    from backends.cuda import step_arena

    monkeypatch.setattr(step_arena, "kept_values", lambda graph: frozenset())
    backend = _backend()
    held, copies = _run(backend, step_arena.StepArena(backend.runner.graph, check=True))
    assert not np.array_equal(held[0].numpy(), copies[0])  # step 0's logits now hold step 1's
    np.testing.assert_array_equal(held[0].numpy(), copies[4])  # the last one-row step's before two rows (0-4 share)


def test_kept_values_follow_views_to_their_source():
    """An output that is a reshape of a slice of a linear's result keeps all three out of the arena; a value an add
    (a new tensor) reads does not."""
    from backends.cuda.step_arena import kept_values
    from ir.graph import Graph

    g = Graph("t")
    x = g.input("x", ("T", 8), "f32")
    y = g.linear(x, g.param("w", (6, 8)))
    part = g.slice(y, start=0, size=4)
    out = g.reshape(part, shape=("T", 2, 2))
    s = g.add(y, y)
    g.output("hidden", out)
    g.output("sum", s)
    keep = kept_values(g)
    assert {y.id, part.id, out.id, s.id} <= keep and x.id not in keep
    z = g.linear(x, g.param("w2", (6, 8)))
    g.output("other", g.add(z, z))
    assert z.id not in kept_values(g)


def test_past_its_bytes_values_are_allocated(launches):  # noqa: F811
    """An arena of no bytes keeps no buffer and no launch that writes one (a kept launch's result would be a buffer
    kept past the limit): the same logits, each value allocated."""
    from backends.cuda import attention
    from backends.cuda.step_arena import StepArena

    _, want = _run(_backend(), None)
    backend = _backend()
    arena = StepArena(backend.runner.graph, max_bytes=0)
    _, got = _run(backend, arena)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not arena._buffers
    # no attention's launches, no linear's (x, w, launch, arguments, y), no chain's (w, residual, inputs, launch,
    # arguments, y): views (x, its views), cuBLAS decisions (None, w) and a step's arrays (meta, arrays, signature)
    assert not any(isinstance(m, attention._Launches) or len(m) in (5, 6) for m in arena.memo.values())
    assert any(len(m) == 2 for m in arena.memo.values())


def test_a_shrinking_batch_keeps_its_padded_rows_launches(launches, monkeypatch):  # noqa: F811
    """An eager decode step's rows padded to a batch bucket (eager.padded_rows): 4, 3 and 3 sequences all run 4 rows,
    so the arena keeps its buffers and launches (the 3-row steps plan no attention; unpadded the first of them plans
    every layer's), and every real row's logits are
    those of the same step unpadded (LLM_ENGINE_EAGER_PAD_ROWS=0) to float32 rounding; no padding row's logits are
    returned."""
    from backends.cuda import attention, eager
    from backends.cuda.step_arena import StepArena

    steps = ([40, 33, 21, 50], [41, 34, 51], [42, 35, 52])

    def run(pad: bool) -> list[np.ndarray]:
        monkeypatch.setattr(eager, "PAD_ROWS", pad)
        backend = _backend()
        eager.use_eager_fusions(backend.runner)
        backend.runner.arena = StepArena(backend.runner.graph, check=True)
        out, attended, real = [], [], attention._attention
        for contexts in steps:
            out.append(backend.forward(_step(contexts)).numpy().copy())
            if contexts is steps[0]:  # the steps after it: a sequence fewer
                monkeypatch.setattr(attention, "_attention", lambda *a: attended.append(1) or real(*a))
        monkeypatch.setattr(attention, "_attention", real)
        assert backend.runner.arena.rows == (4 if pad else 3)
        assert len(attended) == (0 if pad else backend.model.config.num_layers)
        return out

    for got, want, contexts in zip(run(True), run(False), steps, strict=True):
        assert got.shape == (len(contexts), 97)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
