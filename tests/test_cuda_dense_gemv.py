"""The CUDA backend with Runner.dense_gemv on, on CPU tensors (the DSL's kernels under Triton's interpreter; fp32
weights admitted, which the GPU path leaves to cuBLAS): steps of up to 8 rows send their dense linears through
dense_gemv with the norm or gated activation before each fused in (and the residual add after, with add_norm off);
greedy tokens as the reference's, logits as the cuBLAS path's; the chains gemv_fusion.plan finds in a llama graph;
piecewise replays (8-token buckets) running chains inside their pieces."""

from __future__ import annotations

import importlib.util
from collections import Counter

import numpy as np
import pytest
from backend_greedy import backend_greedy
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)

from ir.loader import load_model
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")


@pytest.fixture
def gemv_calls(monkeypatch):
    """fp32 weights admitted; every dense_gemv call recorded as (prologue kind, residual epilogue)."""
    from backends.cuda import gemv_fusion, linears
    from kernels_src import dense_gemv as dg

    monkeypatch.setattr(gemv_fusion, "DTYPES", (*gemv_fusion.DTYPES, torch.float32))
    calls, real = Counter(), dg.dense_gemv

    def spy(*a, prologue=None, residual=None, **kw):
        calls[(dg._prologue_name(prologue), residual is not None)] += 1
        return real(*a, prologue=prologue, residual=residual, **kw)

    monkeypatch.setattr(dg, "dense_gemv", spy)  # gemv_fusion's calls
    monkeypatch.setattr(linears, "dense_gemv", spy)  # the runner's plain linears
    return calls


@pytest.fixture(autouse=True)
def dsl_interpreter(monkeypatch):
    """Every runner's kernels on the DSL interpreter: Triton's takes ~25 ms a GEMV program (a tiny model's greedy
    run: 68 s against 4 s)."""
    from backends.cuda.runner import Runner

    init = Runner.__init__

    def on_numpy(self, *a, **kw):
        init(self, *a, **kw)
        self.target = "numpy"

    monkeypatch.setattr(Runner, "__init__", on_numpy)


def _backend(model, on: bool = True, **kw):
    from backends.cuda.backend import CUDABackend

    b = CUDABackend(model, device="cpu", dtype="f32", progress=False, **kw)
    b.runner.dense_gemv = on
    b.runner.gemv_prologues, b.runner.gemv_max_rows = True, 8  # every chain and row count the kernel takes
    return b


def _chains(backend) -> Counter:
    return Counter((c.prologue.op if c.prologue else None, c.add is not None)
                   for c in backend.runner._gemv_chains.values())


def test_plan_finds_each_projections_prologue(saved, gemv_calls):  # noqa: F811
    """rms_norm -> qkv once, add_rms_norm -> qkv and -> gate_up, gated -> down; o_proj's result goes to an
    add_rms_norm (no chain), the LM head's input through gather_rows (none). With add_norm off: the adds after o_proj
    and down are their epilogues."""
    from ir.fusion import Fusions

    model = load_model(saved("llama3_rope")[1], progress=False)
    layers = model.config.num_layers
    b = _backend(model)
    assert _chains(b) == {("rms_norm", False): 1, ("add_rms_norm", False): 2 * layers - 1, ("gated", False): layers}
    b.set_fusions(Fusions(add_norm=False))
    assert b.runner.dense_gemv  # the switch survives the new runner
    assert _chains(b) == {("rms_norm", False): 2 * layers, ("gated", True): layers, (None, True): layers}


@pytest.mark.parametrize("case", ["llama3_rope", "qwen2"])  # qwen2: q/k/v biases after the fused GEMV
def test_greedy_matches_with_dense_gemv(case, saved, gemv_calls):  # noqa: F811
    """Prompts of 1, 9 and 17 tokens (a prefill past 8 rows: cuBLAS), then 3-row decode steps through the GEMVs."""
    from ir.fusion import Fusions

    model = load_model(saved(case)[1], progress=False)
    prompts = [prompt(1), prompt(2, 9), prompt(3, 17)]
    ref = ReferenceRunner(model, max_tokens=256, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 4)
    plain_tokens, plain_first = backend_greedy(_backend(model, on=False), ref, prompts, 4, 4)
    assert not gemv_calls
    b = _backend(model)
    runs = [backend_greedy(b, ref, prompts, 4, 4)]
    assert {k for k, _ in gemv_calls} == {"none", "rms_norm", "add_rms_norm", "gated"}  # the LM head: "none"
    if case != "qwen2":  # qwen2's biases ride the default chains; the other chain shapes are llama's to check
        gemv_calls.clear()
        b.set_fusions(Fusions(add_norm=False))
        runs.append(backend_greedy(b, ref, prompts, 4, 4))
        assert gemv_calls[("none", True)] and gemv_calls[("gated", True)] and not gemv_calls[("add_rms_norm", False)]
        b.runner.gemv_prologues = False  # plain GEMVs, the small kernels between them
        gemv_calls.clear()
        runs.append(backend_greedy(b, ref, prompts, 4, 4))
        assert set(gemv_calls) == {("none", False)}
    for tokens, first in runs:
        assert tokens == ref_tokens == plain_tokens
        np.testing.assert_allclose(first, plain_first, rtol=1e-5, atol=1e-5 * float(np.abs(plain_first).max()))
        assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())


def test_pieces_run_chains(saved, gemv_calls, monkeypatch):  # noqa: F811
    """Piecewise replays against eager steps, dense_gemv on in both: the 8-token bucket's pieces run the chains."""
    from test_cuda_piecewise import _check_steps

    from backends.cuda.runner import Runner

    init = Runner.__init__  # (on the DSL interpreter already)

    def on(self, *a, **kw):
        init(self, *a, **kw)
        self.dense_gemv, self.gemv_prologues, self.gemv_max_rows = True, True, 8

    monkeypatch.setattr(Runner, "__init__", on)
    _check_steps(load_model(saved("llama3_rope")[1], progress=False), "cpu")
    assert gemv_calls[("add_rms_norm", False)] and gemv_calls[("gated", False)]
