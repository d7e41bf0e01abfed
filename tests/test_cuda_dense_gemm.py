"""The CUDA backend's choice of kernels_src/dense_gemm, on CPU tensors (the DSL interpreter; fp32 weights admitted,
which the GPU path leaves to cuBLAS): a linear goes to the GEMM only where the table lists its (row bucket, N, K),
from 9 rows, with Runner.dense_gemm on; with an empty table nothing changes; greedy tokens and
logits through a tiny llama with every projection listed match the reference's and the cuBLAS path's."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from backend_greedy import backend_greedy
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)

from ir.loader import load_model
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")


@pytest.fixture
def gemm_calls(monkeypatch):
    """fp32 weights admitted, every runner on the DSL interpreter, TUNED emptied; the (rows, N, K) of each
    dense_matmul call the runner makes."""
    from backends.cuda import gemv_fusion, linears, runner
    from kernels_src import dense_gemm as dgm

    monkeypatch.setattr(gemv_fusion, "DTYPES", (*gemv_fusion.DTYPES, torch.float32))
    monkeypatch.setattr(dgm, "TUNED", {})
    init, calls, real = runner.Runner.__init__, [], dgm.dense_matmul

    def on_numpy(self, *a, **kw):
        init(self, *a, **kw)
        self.target = "numpy"

    def spy(x, w, **kw):
        calls.append((x.shape[0], *w.shape))
        return real(x, w, **kw)

    monkeypatch.setattr(runner.Runner, "__init__", on_numpy)
    monkeypatch.setattr(linears, "dense_matmul", spy)
    return calls


def _backend(model, on: bool):
    from backends.cuda.backend import CUDABackend

    b = CUDABackend(model, device="cpu", dtype="f32", progress=False)
    assert not b.runner.dense_gemm  # off on CPU tensors by default
    b.runner.dense_gemm = on
    return b


def test_table_hit_and_miss(saved, gemm_calls):  # noqa: F811
    """Only the listed problem, from MIN_ROWS rows, with the switch on; the result F.linear's."""
    from kernels_src import dense_gemm as dgm

    b = _backend(load_model(saved("llama3_rope")[1], progress=False), on=True)
    w = torch.randn(40, 64) / 8
    x = torch.randn(12, 64)
    assert torch.equal(b.runner.linear(x, w), torch.nn.functional.linear(x, w)) and not gemm_calls  # empty table
    dgm.TUNED[(16, 40, 64)] = dict(block_n=16, block_k=32, split_k=2)
    y = b.runner.linear(x.reshape(3, 4, 64), w)
    assert gemm_calls == [(12, 40, 64)] and y.shape == (3, 4, 40)
    np.testing.assert_allclose(y.reshape(12, 40).numpy(), (x @ w.T).numpy(), rtol=1e-5, atol=1e-5)
    for xm, wm in ((x[:8], w), (torch.randn(17, 64), w), (x, w[:32])):  # under MIN_ROWS; bucket 32; N 32: unlisted
        torch.testing.assert_close(b.runner.linear(xm, wm), torch.nn.functional.linear(xm, wm))
    b.runner.dense_gemm = False
    b.runner.linear(x, w)
    assert gemm_calls == [(12, 40, 64)]


def test_greedy_matches_with_dense_gemm(saved, gemm_calls):  # noqa: F811
    """Prompts of 9 and 17 tokens (a 26-row prefill: bucket 32) and one of 12 alone (bucket 16) through every
    projection listed at small tiles with split-K; the 2-row decode steps stay on cuBLAS."""
    from kernels_src import dense_gemm as dgm

    model = load_model(saved("llama3_rope")[1], progress=False)
    ref = ReferenceRunner(model, max_tokens=256, block_size=4)
    b = _backend(model, on=True)
    shapes = {tuple(p.shape) for p in b.runner.params.values() if isinstance(p, torch.Tensor) and p.dim() == 2}
    for bucket in (16, 32):
        dgm.TUNED.update({(bucket, n, k): dict(block_n=16, block_k=32, split_k=2) for n, k in shapes})
    for prompts in ([prompt(2, 9), prompt(3, 17)], [prompt(4, 12)]):
        ref_tokens, ref_first = ref.greedy(prompts, 3)
        plain_tokens, plain_first = backend_greedy(_backend(model, on=False), ref, prompts, 3, 4)
        gemm_calls.clear()
        tokens, first = backend_greedy(b, ref, prompts, 3, 4)
        rows = sum(map(len, prompts))
        assert gemm_calls and {r for r, _, _ in gemm_calls} <= {rows, len(prompts)}  # the LM head: one row a prompt
        assert tokens == ref_tokens == plain_tokens
        np.testing.assert_allclose(first, plain_first, rtol=1e-5, atol=1e-5 * float(np.abs(plain_first).max()))
        assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
