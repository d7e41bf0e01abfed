"""The MLX backend against the IR reference interpreter: SmolLM2 (dense and MLX-quantized) and the
tiny random models of every architecture, with the reference's reversed block tables."""

from __future__ import annotations

import numpy as np
import pytest
from backend_greedy import backend_greedy as greedy
from test_tiny_models import MAIN, prompt, saved  # noqa: F401  (saved is a fixture)

from backends.mlx.backend import MLXBackend
from core.batch import make_batch
from ir.loader import load_model
from ir.reference import ReferenceRunner

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def backend_greedy(backend: MLXBackend, prompts: list[list[int]], n: int, block_size: int = 16):
    """Greedy decoding of all prompts together straight through backend.forward."""
    return greedy(backend, ReferenceRunner(backend.model, max_tokens=256, block_size=block_size), prompts, n,
                  block_size)


@pytest.fixture(scope="module")
def smollm_reference(smollm):
    ids = smollm.tokenizer.apply_chat_template(QUESTION)
    tokens, first = ReferenceRunner(smollm).greedy([ids], 16)
    return ids, tokens[0], first[0]


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mlx_affine"])
def test_smollm_matches_reference(smollm, mlx_smollm, smollm_reference, quantized):
    ids, ref_tokens, ref_first = smollm_reference
    backend = MLXBackend(smollm, quantized=True, progress=False) if quantized else mlx_smollm
    if quantized:
        assert backend.fallbacks == {}, "every SmolLM2 matrix maps exactly onto MLX affine groups"
    tokens, first = backend_greedy(backend, [ids], 16)
    err = float(np.abs(first[0] - ref_first).max())
    assert err < 1e-3, f"step-0 logits differ by {err}"
    assert tokens[0] == ref_tokens
    assert "Paris" in smollm.tokenizer.decode(tokens[0])


def test_smollm_prompt_logits_all_positions(smollm, mlx_smollm, smollm_reference):
    ids = smollm_reference[0]
    ref = ReferenceRunner(smollm).prompt_logits(ids)
    table = list(range(7, -1, -1))
    mlx_smollm.allocate_kv(8, 16)
    ours = mlx_smollm.forward(make_batch([ids], [0], [table], 16, all_logits=True))
    assert float(np.abs(ours - ref).max()) < 1e-3


@pytest.mark.parametrize("case", MAIN + ["qwen2_swa"])
def test_tiny_models_match_reference(case, saved):  # noqa: F811
    _, folder = saved(case)
    model = load_model(folder, progress=False)
    backend = MLXBackend(model, progress=False)
    prompts = [prompt(1), prompt(2, 9), prompt(3, 17)]
    ref_tokens, ref_first = ReferenceRunner(model, max_tokens=256, block_size=4).greedy(prompts, 12)
    tokens, first = backend_greedy(backend, prompts, 12, block_size=4)
    scale = float(np.abs(ref_first).max())
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * scale
    assert tokens == ref_tokens


def test_chunked_prefill_over_cached_context(smollm, mlx_smollm, smollm_reference):
    """A prompt fed in three chunks (and a decode riding in the same batch) gives the reference logits."""
    ids = smollm_reference[0]
    ref = ReferenceRunner(smollm).prompt_logits(ids)
    mlx_smollm.allocate_kv(16, 16)
    a, b = [5, 3, 9], [1, 0, 12]
    mlx_smollm.forward(make_batch([ids[:10], ids[:20]], [0, 0], [a, b], 16))
    out = mlx_smollm.forward(make_batch([ids[10:30], ids[20:21]], [10, 20], [a, b], 16, all_logits=True))
    assert float(np.abs(out[:20] - ref[10:30]).max()) < 1e-3
    assert float(np.abs(out[20] - ref[20]).max()) < 1e-3


@pytest.mark.parametrize("case", ["qwen3", "mistral_window"])
def test_dsl_kernel_wiring_through_the_simt_oracle(case, saved):  # noqa: F811
    """The Metal wiring (norms, gated activations, paged decode attention with split-K) run through the
    DSL's CPU execution of the same lowered SIMT programs: greedy tokens equal the reference's."""
    _, folder = saved(case)
    model = load_model(folder, progress=False)
    backend = MLXBackend(model, kernels="simt-cpu", progress=False)
    assert backend.kernels is not None and backend.decode is None
    prompts = [prompt(1), prompt(2, 9)]
    ref_tokens, ref_first = ReferenceRunner(model, max_tokens=256, block_size=4).greedy(prompts, 6)
    tokens, first = backend_greedy(backend, prompts, 6, block_size=4)
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
    assert tokens == ref_tokens
    assert set(backend.kernels.launches) == {"rms_norm", "gated", "paged_decode"}


def test_split_k_decode_kernel_matches_mlx_ops():
    """A context longer than one partition (512) takes the split-K kernels and their reduction."""
    from backends.mlx.attention import _attend
    from backends.mlx.metal_ops import KernelOps
    from backends.mlx.runtime import mx

    rng = np.random.default_rng(0)
    bs, hkv, hq, d, n_blocks = 16, 2, 4, 32, 80
    kc = mx.array(rng.standard_normal((n_blocks * bs, hkv, d)).astype(np.float32))
    vc = mx.array(rng.standard_normal((n_blocks * bs, hkv, d)).astype(np.float32))
    ctx = np.array([1100, 37], np.int32)
    tables = np.stack([rng.permutation(n_blocks)[:72], rng.permutation(n_blocks)[:72]]).astype(np.int32)
    q = mx.array(rng.standard_normal((2, hq, d)).astype(np.float32))
    out = KernelOps("simt-cpu").paged_decode(q, kc, vc, bs, mx.array(tables), mx.array(ctx), 1152, 0.2, None, None)
    for b in range(2):
        j = np.arange(ctx[b])
        slots = mx.array((tables[b, j // bs] * bs + j % bs).astype(np.int32))
        keys, vals = kc[slots].transpose(1, 0, 2)[None], vc[slots].transpose(1, 0, 2)[None]
        ref = _attend(q[b][None, :, None, :], keys, vals, mx.ones((1, 1, 1, int(ctx[b])), dtype=mx.bool_), 0.2, None)
        assert float(mx.abs(out[b] - ref[0, :, 0, :]).max()) < 1e-4


def test_metal_launches_trace_on_any_machine(tmp_path):
    """Without a Mac, mlx still traces metal_kernel calls inside export_function: the launches the
    backend makes on Metal (inputs, output shapes and dtypes, grids) are accepted by mlx."""
    from backends.mlx.metal_ops import KernelOps
    from backends.mlx.runtime import mx

    ops = KernelOps("metal")
    x, w = mx.ones((3, 64)), mx.ones((64,))
    gate, up = mx.ones((3, 96)), mx.ones((3, 96))
    q, cache = mx.ones((2, 4, 32)), mx.ones((40 * 16, 2, 32))
    tables, ctx = mx.zeros((2, 64), dtype=mx.int32), mx.array([700, 5], dtype=mx.int32)

    def step(x, w, gate, up, q, cache, tables, ctx):
        return [ops.rms_norm(x, w, 1e-5), ops.gated("silu", gate, up),
                ops.paged_decode(q, cache, cache, 16, tables, ctx, 1024, 0.2, None, None)]

    mx.export_function(str(tmp_path / "step.mlxfn"), step, x, w, gate, up, q, cache, tables, ctx)
    assert (tmp_path / "step.mlxfn").stat().st_size > 0
    assert ops.launches == {"rms_norm": 1, "gated": 1, "paged_decode": 1}
