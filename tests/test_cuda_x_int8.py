"""x's int8 pass fused into the norm and the gated activation (backends/cuda/x_int8_fusion.py), through the CUDA
backend on CPU tensors: a one-layer Q4_K / Q6_K llama (and one of random 4-bit integer groups, GPTQ's layout)
decoding one sequence, the fusion off and on. The int8 GEMVs are the runner's path on the "triton" target only;
here their I8_TARGETS are widened to the interpreter, so the same GEMVs run (counted through pass-through
wrappers), and with the fusion x's int8 form comes from the norm and activation kernels instead of quantize_x
(quantize_x_i8): bit for bit the same, so the logits are too.

The runner's kernels run on the DSL's numpy interpreter (target "numpy"), not Triton's (the CPU backend's default):
under Triton's interpreter one int8 GEMV of 256 x 256 takes 14-22 s (its dp4a emulated), this whole test ~15 s.
tests/test_x_int8.py checks the fused kernels' output on Triton's interpreter too."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from backend_greedy import host
from gguf_write import write_kquant_llama

from core.batch import make_batch
from ir.loader import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")
# the smallest k-quant shapes: K a multiple of 256 (one super-block a row)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 256, 1, 4, 2, 96
STEPS = 2  # one token, then a decode step reading its keys and values: one row each


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    rng = np.random.default_rng(13)
    path = tmp_path_factory.mktemp("xq") / "xq.gguf"
    write_kquant_llama(path, rng, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB, 64,
                       lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    return path


def _count(monkeypatch, module, name: str, given_at: int, calls: list) -> None:
    """Count module.name's calls as (name, whether its argument `given_at` (x's int8 form) was given)."""
    real = getattr(module, name)

    def counted(*a, **kw):
        calls.append((name, kw.get("x_int8", a[given_at] if len(a) > given_at else None) is not None))
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)


def _given(monkeypatch, module, name: str, calls: list, pick) -> None:
    """Record ("given", whether pick(args, kwargs), x's int8 form handed to module.name, is not None) a call."""
    real = getattr(module, name)

    def recorded(*a, **kw):
        calls.append(("given", pick(a, kw) is not None))
        return real(*a, **kw)

    monkeypatch.setattr(module, name, recorded)


def _gguf_counted():
    from kernels_src import dequant_gemv_i8, x_int8

    return [(dequant_gemv_i8, "quantize_x", 99), (dequant_gemv_i8, "gemv_i8", 11), (x_int8, "add_rms_norm_q8", 99),
            (x_int8, "gated_act_q8", 99)]


def _decode(model, fusion: bool, device: str, graphs: bool, monkeypatch, counted=None,
            params=None) -> tuple[np.ndarray, list]:
    """Each step's logits [STEPS, vocab] of one greedy sequence, and the counted launches (as Python launched them:
    with CUDA graphs, those of the captures)."""
    from backends.cuda.backend import CUDABackend

    calls: list = []
    for module, name, given_at in counted or _gguf_counted():
        _count(monkeypatch, module, name, given_at, calls)
    backend = CUDABackend(model, device=device, dtype="f32", cuda_graph=graphs, progress=False, params=params)
    backend.runner.x_int8_fusion = fusion  # before allocate_kv, which captures the graphs
    if device == "cpu":
        backend.runner.target = "numpy"
    backend.allocate_kv(2, 8)
    chunk, cached, logits = [3], 0, []
    for _ in range(STEPS):
        step = host(backend.forward(make_batch([chunk], [cached], [[1, 0]], 8)))[0]  # blocks in reverse order
        logits.append(step)
        cached += len(chunk)
        chunk = [int(step.argmax())]
    monkeypatch.undo()
    return np.stack(logits), calls


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.mark.parametrize("device,graphs", [("cpu", False), pytest.param("cuda", False, marks=GPU),
                                           pytest.param("cuda", True, marks=GPU)])
def test_fusion_feeds_the_int8_gemv_the_same_codes(device, graphs, model_file, monkeypatch):
    """On a GPU (the "triton" target: the int8 GEMV without widening) eagerly and through CUDA graphs, whose
    replays run the fused kernels Python launched while capturing."""
    from backends.cuda import x_int8_fusion
    from kernels_src import dequant_gemv_i8

    model = load_model(model_file, progress=False)
    widen = (*dequant_gemv_i8.I8_TARGETS, "numpy")  # the interpreter takes the int8 GEMV, as "triton" does
    runs = {}
    for fusion in (False, True):
        monkeypatch.setattr(dequant_gemv_i8, "I8_TARGETS", widen)
        runs[fusion] = _decode(model, fusion, device, graphs, monkeypatch)
    (off, off_calls), (on, on_calls) = runs[False], runs[True]
    assert any(n == "add_rms_norm_q8" for n, _ in on_calls) and not any(n.endswith("_q8") for n, _ in off_calls)
    if device == "cuda":  # Triton may sum a norm's row in another order in the fused kernel: an ulp of x can flip
        # a code at a rounding boundary, which moves y by one step of x's scale
        np.testing.assert_allclose(on, off, rtol=0, atol=1e-3 * float(np.abs(off).max()))
        if graphs:
            return
    gemvs = STEPS * (LAYERS * 5 + 1)  # q+k (fused: both Q4_K), v, o, gate+up, down a layer and the head, a step
    assert sum(n == "gemv_i8" for n, _ in off_calls) == sum(n == "gemv_i8" for n, _ in on_calls) == gemvs
    # off: one quantize_x a GEMV, none given codes
    assert sum(n == "quantize_x" for n, _ in off_calls) == gemvs and not any(q for _, q in off_calls)
    assert not any(n.endswith("_q8") for n, _ in off_calls)
    # on: the add_rms_norms before projections (each ffn norm, later layers' attention norms) and the gated
    # activations write the codes; quantize_x is left to layer 0's q+k and v (a plain rms_norm before them), each o
    # (attention's x) and the head (its x a gather_rows of the final norm's)
    norms, acts, left = STEPS * (2 * LAYERS - 1), STEPS * LAYERS, STEPS * (3 + LAYERS)
    assert sum(n == "add_rms_norm_q8" for n, _ in on_calls) == norms
    assert sum(n == "gated_act_q8" for n, _ in on_calls) == acts
    assert sum(n == "quantize_x" for n, _ in on_calls) == left
    assert sum(n == "gemv_i8" and given for n, given in on_calls) == gemvs - left
    # the same codes, so the same logits (exactly on the interpreter: the same fp32 arithmetic in the same order)
    if device == "cpu":
        np.testing.assert_array_equal(on, off)
    assert x_int8_fusion.enabled(None) == x_int8_fusion.DEFAULT


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_fusion_feeds_the_int_group_gemv_the_same_arrays(device, monkeypatch):
    """The same for 4-bit integer groups of 128 (GPTQ / AWQ once loaded; bench_gpu's random int4 weights): the
    norm and activation kernels write quantize_x_i8's arrays, the GEMVs take them, the logits stay equal (on a GPU
    within 0.1%, as above)."""
    from ir.rope import RopeSpec
    from kernels_src import int_group_gemv_i8, x_int8_groups
    from tools.bench_gpu_model import int4_params, loaded_model, model_config

    cfg = model_config(LAYERS).with_(hidden_size=HIDDEN, intermediate_size=FFN, vocab_size=VOCAB, num_heads=HEADS,
                                     num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS, max_position_embeddings=64,
                                     rope=RopeSpec(theta=10000.0, rotary_dim=HIDDEN // HEADS))
    model = loaded_model(cfg)
    params = int4_params(model.graph, device=device)  # 16-bit tensors all ones there: x would repeat one value
    gen = torch.Generator().manual_seed(5)
    for name, p in params.items():
        if not hasattr(p, "qtype"):
            params[name] = (p + 0.5 * torch.randn(p.shape, generator=gen).to(device)).to(p.dtype)
    counted = [(int_group_gemv_i8, "quantize_x_i8", 99), (int_group_gemv_i8, "gemv_i8", 12),
               (x_int8_groups, "add_rms_norm_i8g", 99), (x_int8_groups, "gated_act_i8g", 99)]
    runs = {}
    for fusion in (False, True):
        monkeypatch.setattr(int_group_gemv_i8, "I8_TARGETS", ("triton", "numpy"))  # the interpreter's int8 GEMV
        runs[fusion] = _decode(model, fusion, device, False, monkeypatch, counted, dict(params))
    (off, off_calls), (on, on_calls) = runs[False], runs[True]
    gemvs = sum(n == "gemv_i8" for n, _ in off_calls)
    assert gemvs == sum(n == "gemv_i8" for n, _ in on_calls) >= STEPS * (LAYERS * 4 + 1)
    assert sum(n == "quantize_x_i8" for n, _ in off_calls) == gemvs and not any(g for _, g in off_calls)
    fused = sum(n == "gemv_i8" and given for n, given in on_calls)
    # ffn norms, gated activations and later layers' attention norms
    assert sum(n.endswith("_i8g") for n, _ in on_calls) == STEPS * (3 * LAYERS - 1)
    assert fused >= STEPS * 2 and sum(n == "quantize_x_i8" for n, _ in on_calls) == gemvs - fused
    if device == "cuda":
        np.testing.assert_allclose(on, off, rtol=0, atol=1e-3 * float(np.abs(off).max()))
    else:
        np.testing.assert_array_equal(on, off)


@pytest.mark.parametrize("tokens", [6, 20])
def test_fusion_feeds_the_mmq_its_per256_pre_pass(tokens, model_file, monkeypatch):
    """A prompt of 4-32 tokens takes the MMQ (kernels_src/gguf_mmq, per256) for its Q4_K / Q6_K linears: with the
    fusion the ffn norm writes the per256 pre-pass (6 tokens: BLOCK_M 16, fp32 sums; 20: BLOCK_M 32, where Q4_K's
    gate+up reads split fp16 sums) and the gated activation the down projection's (Q6_K: fp32 sums at both), the
    MMQs take them instead of running quantize_x256, and the logits are equal (the same codes)."""
    from backends.cuda import gguf_linear
    from backends.cuda.backend import CUDABackend
    from kernels_src import dequant_gemv_i8, gguf_mmq_sb, x_int8

    model = load_model(model_file, progress=False)
    chunk = [int(t) for t in np.random.default_rng(tokens).integers(1, VOCAB, tokens)]
    runs = {}
    for fusion in (False, True):
        widen = (*dequant_gemv_i8.I8_TARGETS, "numpy")  # the interpreter takes the int8 paths, as "triton" does
        monkeypatch.setattr(gguf_linear, "I8_TARGETS", widen)
        monkeypatch.setattr(dequant_gemv_i8, "I8_TARGETS", widen)
        calls: list = []
        for module, name, given_at in ((gguf_linear, "mmq", 99), (gguf_mmq_sb, "quantize_x256", 99),
                                       (x_int8, "add_rms_norm_q8", 99), (x_int8, "gated_act_q8", 99)):
            _count(monkeypatch, module, name, given_at, calls)
        _given(monkeypatch, gguf_linear, "mmq", calls, lambda a, kw: kw["xq"])
        backend = CUDABackend(model, device="cpu", dtype="f32", cuda_graph=False, progress=False)
        backend.runner.x_int8_fusion = fusion
        backend.runner.target = "numpy"
        backend.allocate_kv(4, 8)
        logits = host(backend.forward(make_batch([chunk], [0], [[3, 2, 1, 0]], 8)))
        monkeypatch.undo()
        runs[fusion] = logits, calls
    (off, off_calls), (on, on_calls) = runs[False], runs[True]
    mmqs = 4  # q+k (fused: both Q4_K), v (Q6_K), o, gate+up; down (Q6_K); the head reads the last token alone
    assert sum(n == "mmq" for n, _ in off_calls) == sum(n == "mmq" for n, _ in on_calls) == mmqs + 1
    assert sum(n == "quantize_x256" for n, _ in off_calls) == mmqs + 1 and not any(
        g for n, g in off_calls if n == "given")
    # on: gate+up and down take the norm's and the activation's pre-pass; layer 0's q+k and v (after a plain
    # rms_norm) and o (attention's x) run their own
    assert [n for n, _ in on_calls].count("add_rms_norm_q8") == [n for n, _ in on_calls].count("gated_act_q8") == 1
    assert sum(g for n, g in on_calls if n == "given") == 2
    assert sum(n == "quantize_x256" for n, _ in on_calls) == mmqs + 1 - 2
    np.testing.assert_array_equal(on, off)


def test_fusion_feeds_the_int_group_mmq_its_pre_pass(monkeypatch):
    """A 12-token prompt over 4-bit integer groups takes int_group_gemm (9-128 rows); where its variant is mmq for
    every reader (LLM_ENGINE_INT_MMQ=1's rule: the tiny shapes are not in TUNED), the ffn norm and the gated
    activation write quantize_x_mmq's xq and xs, the GEMMs take them instead of running it, the logits are equal."""
    from backends.cuda.backend import CUDABackend
    from ir.rope import RopeSpec
    from kernels_src import int_group_gemm, int_group_mmq, x_int8_groups
    from tools.bench_gpu_model import int4_params, loaded_model, model_config

    cfg = model_config(LAYERS).with_(hidden_size=HIDDEN, intermediate_size=FFN, vocab_size=VOCAB, num_heads=HEADS,
                                     num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS, max_position_embeddings=64,
                                     rope=RopeSpec(theta=10000.0, rotary_dim=HIDDEN // HEADS))
    model = loaded_model(cfg)
    params = int4_params(model.graph, device="cpu")
    gen = torch.Generator().manual_seed(7)
    for name, p in params.items():
        if not hasattr(p, "qtype"):
            params[name] = (p + 0.5 * torch.randn(p.shape, generator=gen)).to(p.dtype)
    chunk = [int(t) for t in np.random.default_rng(12).integers(1, VOCAB, 12)]
    runs = {}
    for fusion in (False, True):
        monkeypatch.setattr(int_group_gemm, "MMQ", True)
        calls: list = []
        for module, name in ((int_group_mmq, "quantize_x_mmq"), (x_int8_groups, "add_rms_norm_mmq"),
                             (x_int8_groups, "gated_act_mmq")):
            _count(monkeypatch, module, name, 99, calls)
        _given(monkeypatch, int_group_gemm, "launch_mmq", calls, lambda a, kw: a[-1])
        backend = CUDABackend(model, device="cpu", dtype="f32", cuda_graph=False, progress=False,
                              params=dict(params))
        backend.runner.x_int8_fusion = fusion
        backend.runner.target = "numpy"
        backend.allocate_kv(2, 8)
        runs[fusion] = host(backend.forward(make_batch([chunk], [0], [[1, 0]], 8))), calls
        monkeypatch.undo()
    (off, off_calls), (on, on_calls) = runs[False], runs[True]
    gemms = sum(n == "given" for n, _ in off_calls)
    assert gemms == sum(n == "given" for n, _ in on_calls) >= 4  # qkv, o, gate+up, down (the head: one row)
    assert sum(n == "quantize_x_mmq" for n, _ in off_calls) == gemms
    assert not any(g for n, g in off_calls if n == "given")
    # on: gate+up after the ffn norm and down after the activation take theirs; layer 0's qkv (a plain rms_norm
    # before it) and o run the pre-pass
    assert [n for n, _ in on_calls].count("add_rms_norm_mmq") == [n for n, _ in on_calls].count("gated_act_mmq") == 1
    assert sum(g for n, g in on_calls if n == "given") == 2
    assert sum(n == "quantize_x_mmq" for n, _ in on_calls) == gemms - 2
    np.testing.assert_array_equal(on, off)
