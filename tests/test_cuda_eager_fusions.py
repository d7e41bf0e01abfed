"""The eager fusions (backends/cuda/eager.py: a GPU backend's with CUDA graphs off): a one-row decode step with the
GEMV prologues and the decode's reduce inside the decode gives the unfused step's logits and next token, in fewer
launches; repeated, through the launch plans its first call made, the same logits again.

On CPU tensors, a tiny synthetic llama in fp32 (the GEMV admits fp32 here, as tests/test_cuda_dense_gemv.py does),
its kernels on the DSL's numpy interpreter; short decode partitions so that a 200-token context is split-K."""

from __future__ import annotations

import importlib.util
from collections import Counter

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")

BLOCK, CONTEXT = 16, 256


@pytest.fixture
def launches(monkeypatch):
    """Every DSL launch counted by kernel; fp32 weights taken by the GEMV; the runner's kernels on the DSL's
    interpreter (Triton's takes ~25 ms a GEMV program)."""
    from backends.cuda import gemv_fusion
    from kernels_src.dsl import launch

    monkeypatch.setattr(gemv_fusion, "DTYPES", (*gemv_fusion.DTYPES, torch.float32))
    seen, real = Counter(), launch.Kernel.launch

    def spy(kernel, grid, args):
        seen[kernel.fn.__name__] += 1
        return real(kernel, grid, args)

    monkeypatch.setattr(launch.Kernel, "launch", spy)
    return seen


def _backend(seqs: int = 4):
    from backends.cuda.backend import CUDABackend
    from backends.cuda.decode_table import DecodeTable
    from ir.config import ModelConfig
    from ir.loader import synthetic_model
    from ir.rope import RopeSpec

    cfg = ModelConfig(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                      head_dim=16, num_layers=2, rms_norm_eps=1e-5, max_position_embeddings=CONTEXT,
                      rope=RopeSpec(theta=10000.0, rotary_dim=16))
    model = synthetic_model(cfg, "f32")
    backend = CUDABackend(model, dtype="f32", device="cpu", cuda_graph=False, random_weights=3, progress=False)
    runner = backend.runner
    runner.target, runner.dense_gemv, runner.gemv_max_rows = "numpy", True, 1  # a GPU's GEMVs: one-row steps
    runner.decode = DecodeTable.parse("64:32/16x4,max=16")  # 32-key partitions: a 200-token context in 7
    backend.set_limits(seqs, CONTEXT)
    backend.allocate_kv(max(4 * (CONTEXT // BLOCK), seqs * 4), BLOCK)
    gen = torch.Generator().manual_seed(0)
    for layer in backend.kv:  # a cache of random keys and values: the attention reads what the step did not write
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=gen))
    return backend


def _step(contexts):
    """A decode step of len(contexts) sequences, each in its own blocks."""
    from core.batch import make_batch

    tables, at = [], 0
    for ctx in contexts:
        tables.append(list(range(at, at + -(-ctx // BLOCK))))
        at += len(tables[-1])
    return make_batch([[7 + i] for i in range(len(contexts))], [c - 1 for c in contexts], tables, BLOCK)


def test_fused_eager_decode_matches_unfused(launches):
    from backends.cuda import eager

    backend = _backend()
    runner = backend.runner
    assert not runner.gemv_prologues and not runner.fused_reduce  # CPU tensors: unfused unless asked
    for contexts in ([200], [200, 37, 120]):
        step = _step(contexts)
        runner.gemv_prologues, runner.fused_reduce = False, False
        launches.clear()
        plain = backend.forward(step).numpy().copy()
        unfused = Counter(launches)
        eager.use_eager_fusions(runner)
        assert runner.gemv_prologues and runner.fused_reduce
        launches.clear()
        fused = backend.forward(step).numpy().copy()
        layers = backend.model.config.num_layers
        # the reduce inside the decode at every row count; the prologues at one row: rms_norm (layer 0) or
        # add_rms_norm -> qkv, add_rms_norm -> gate_up, gated -> down, 3 launches a layer
        assert launches["paged_decode_reduce_kernel"] == 0 and unfused["paged_decode_reduce_kernel"] == layers
        assert launches["paged_decode_rope_fused_kernel"] == layers  # rope and the cache write inside the decode
        assert not launches["rope_kv_write_kernel"] and not unfused["rope_kv_write_kernel"]
        fewer = sum(unfused.values()) - sum(launches.values())
        assert fewer == layers * (4 if len(contexts) == 1 else 1), (unfused, launches)
        # the prologue keeps x' in fp32 and scales the finished dot product: fp32 rounding apart
        np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))
        assert (fused.argmax(-1) == plain.argmax(-1)).all()
        assert not any(c.any() for c in runner._counters)  # the combine left its counters at 0
        # a repeated step launches through the plans its first call made: the same logits
        np.testing.assert_array_equal(backend.forward(step).numpy(), fused)



def test_eager_dense_gemm_replays(launches, monkeypatch):
    """From 9 rows, an eager step's linears that dense_gemm's table lists run it (as under graphs), launched again
    from the step before through dense_gemm.launched: F.linear's logits (fp32 rounding apart); a repeated step plans
    nothing, calls no dense_matmul, launches the same GEMMs and split-K reduces, and gives the same logits."""
    from backends.cuda import eager, linears
    from kernels_src import dense_gemm as dgm

    backend = _backend(seqs=12)
    runner = backend.runner
    eager.use_eager_fusions(runner)
    shapes = {tuple(p.shape) for p in runner.params.values() if isinstance(p, torch.Tensor) and p.dim() == 2}
    monkeypatch.setattr(dgm, "TUNED", {(16, n, k): dict(block_n=16, block_k=32, split_k=2) for n, k in shapes})
    monkeypatch.setattr(dgm, "_PLANS", type(dgm._PLANS)())
    planned, matmuls, calls = [], [], []
    real_plan, real_matmul, real_launched = dgm._plan, linears.dense_matmul, linears.dense_gemm_launched
    monkeypatch.setattr(dgm, "_plan", lambda *a: planned.append(a[1].shape) or real_plan(*a))
    monkeypatch.setattr(linears, "dense_matmul", lambda *a, **k: matmuls.append(1) or real_matmul(*a, **k))
    monkeypatch.setattr(linears, "dense_gemm_launched", lambda *a, **k: calls.append(1) or real_launched(*a, **k))
    step = _step([20 + 7 * i for i in range(12)])  # 12 rows: the table's 16-row bucket
    runner.dense_gemm = False  # F.linear (cuBLAS on a GPU)
    plain = backend.forward(step).numpy().copy()
    runner.dense_gemm = True
    launches.clear()
    first = backend.forward(step).numpy().copy()
    gemms = launches["dense_gemm_kernel"]
    assert gemms >= 3 * backend.model.config.num_layers and launches["dequant_gemm_reduce_kernel"] == gemms
    assert len(planned) == len(set(planned)) > 0 and not matmuls  # one plan a problem, each made once
    np.testing.assert_allclose(first, plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))
    assert (first.argmax(-1) == plain.argmax(-1)).all()
    planned.clear()
    launches.clear()
    calls.clear()
    from kernels_src import activations, rms_norm

    norms, acts, real_norm, real_act = [], [], rms_norm._launch, activations.gated_act_launched
    monkeypatch.setattr(rms_norm, "_launch", lambda kernel, *a: norms.append(kernel.__name__) or real_norm(kernel, *a))
    monkeypatch.setattr(activations, "gated_act_launched", lambda *a, **k: acts.append(1) or real_act(*a, **k))
    again = backend.forward(step).numpy()
    # the add_rms_norms and gated activations relaunched from the memo too, but for layer 0's two norms, which read
    # the gathered embeddings (a new tensor each step): its rms_norm, and its add_rms_norm's residual
    assert sorted(norms) == ["add_rms_norm_kernel", "rms_norm_kernel"] and not acts
    assert launches["add_rms_norm_kernel"] == 2 * backend.model.config.num_layers  # (the last one: the final norm)
    # every GEMM relaunched from the arena's memo (not even launched's plan lookup) but two whose x is a new tensor
    # each step: layer 0's qkv (rms_norm of the gathered embeddings) and the head's (the rows at logits_indices)
    assert not planned and not matmuls and len(calls) == 2 and launches["dense_gemm_kernel"] == gemms
    np.testing.assert_array_equal(again, first)

def test_view_runs_match_their_nodes():
    """node_steps folds the q/k/v slices and their reshapes (and the gate/up slices) into one split each: the same
    views (values, shapes, strides, addresses) as the nodes one by one, on a fused projection's output and on one
    whose last dim is strided (the fallback: the nodes' own views)."""
    from backends.cuda import node_steps

    backend = _backend()
    nodes = backend.runner.graph.nodes
    steps, runs, i = backend.runner._steps(nodes), [], 0
    while i < len(steps):  # as run_nodes walks them (chains off)
        views = steps[i][4]
        runs += [(i, views)] if views is not None and views[1] > 1 else []
        i += views[1] if views is not None else 1
    layers = backend.model.config.num_layers
    assert sorted(span for _, (_, span, _, _) in runs) == [2] * layers + [6] * layers
    for i, (fn, span, outs, _) in runs:
        src = nodes[i].inputs[0]
        for x in (torch.randn(3, src.shape[-1]), torch.randn(3, 2 * src.shape[-1])[:, ::2]):
            env = {src.id: x}
            for node in nodes[i:i + span]:  # one by one, as run_node took them
                env[node.out.id] = node_steps.view(node)(env[node.inputs[0].id])
            got = fn(x)
            assert len(got) == len(outs)
            for vid, t in zip(outs, got, strict=True):
                want = env[vid]
                assert t.shape == want.shape and t.stride() == want.stride() and t.data_ptr() == want.data_ptr()
                assert torch.equal(t, want)
