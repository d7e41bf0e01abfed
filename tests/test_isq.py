"""In-situ quantization (`--isq`, ir/isq.py): which tensors become which GGUF type (llama-quantize's choices and
fallbacks) or int4/fp8 kind, the stored blocks against our quantizer on the float weights, and tiny random llamas
quantized at load through MLX's CPU build and the CUDA backend on CPU tensors (the DSL's interpreter) against the
numpy interpreter on the same quantized weights (tight), and the quantized models against the float model (loose, see
FLOAT_TOL)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from backend_greedy import backend_greedy
from tiny_hf import random_causal_lm, random_prompt, saved_models
from transformers import LlamaConfig

from ir.formats.gguf_quantize import quantize
from ir.isq import isq_kind, roles, target_kind
from ir.loader import load_model
from ir.reference import ReferenceRunner

torch.set_num_threads(1)

VOCAB = 320
# hidden and intermediate a whole number of 256-value super-blocks, so that the k-quants apply without fallback.
WIDE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
CASES = {"wide": dict(tie_word_embeddings=False), "wide_tied": dict(tie_word_embeddings=True),
         "narrow": dict(hidden_size=64, intermediate_size=96, head_dim=16, tie_word_embeddings=False)}
# Backend vs the interpreter on the same quantized weights: fp32 on both sides, the only difference is rounding.
SAME_WEIGHTS_TOL = 1e-4
# Quantized vs float model: RMS of the first step's logit error over the logits' std. These random models amplify
# weight error ~4x (q8_0's 0.5% per matrix moves the logits 2.3%); measured q8_0 0.023, q4k 0.27, q4_0 0.36, int4
# (groups of 128) 0.33, fp8 (e4m3's 3 mantissa bits) 0.095. Logits unrelated to the float model's (a wrong nibble
# order, scale or zero point) give ~1.4.
FLOAT_TOL = {"q8_0": 0.035, "q4k": 0.35, "q4_0": 0.45, "int4": 0.42, "fp8": 0.13}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_models(tmp_path_factory, lambda c: random_causal_lm(LlamaConfig(**{**WIDE, **CASES[c]}), 0))


def _prompts():
    return [random_prompt(1, 17, VOCAB), random_prompt(2, 5, VOCAB)]


@pytest.mark.parametrize("isq", ["q4_0", "q4k", "q8_0"])
def test_kinds_follow_llama_quantize(isq, saved):
    _, folder = saved("wide")
    model = load_model(folder, progress=False, isq=isq)
    base = isq_kind(isq)
    kinds = model.weights.kinds()
    head = "Q8_0" if base == "Q8_0" else "Q6_K"
    assert kinds["lm_head"] == head and kinds["embed"] == base
    mats = [p for p, r in roles(model.graph).items() if r == "matrix"]
    assert len(mats) == 7 and all(kinds[p] == base for p in mats)
    assert all(kinds[p] == "F32" for p in kinds if p not in mats and p not in ("embed", "lm_head"))
    # The blocks are our quantizer's on the float weights.
    dense = load_model(folder, progress=False)
    for p in ("layers.0.wq", "layers.0.w_down", "lm_head", "embed"):
        np.testing.assert_array_equal(model.weights[p].data, quantize(dense.weights[p].values(), kinds[p]))


def test_tied_embedding_is_the_head(saved):
    _, folder = saved("wide_tied")
    model = load_model(folder, progress=False, isq="q4k")
    assert roles(model.graph)["embed"] == "head" and model.weights["embed"].kind == "Q6_K"


def test_fallbacks_are_llama_cpps_and_logged(saved, caplog):
    _, folder = saved("narrow")  # rows of 64 and 96 values: no 256-value super-block fits
    with caplog.at_level(logging.WARNING, logger="ir.isq"):
        model = load_model(folder, progress=False, isq="q4k")
    kinds = model.weights.kinds()
    assert kinds["layers.0.wq"] == "Q5_0" and kinds["layers.0.w_down"] == "Q5_0" and kinds["lm_head"] == "Q8_0"
    assert "rows of 64 values (not a whole number of 256-value blocks) fall back to Q5_0" in caplog.text
    assert [target_kind(k, "matrix", 64) for k in ("Q2_K", "Q3_K", "Q5_K", "Q6_K")] == \
        ["Q4_0", "Q4_0", "Q5_1", "Q8_0"]
    assert target_kind("Q4_0", "matrix", 48) is None and target_kind("Q4_0", "head", 48) is None


def test_refusals():
    with pytest.raises(ValueError, match="unknown --isq type 'q4'; expected one of q4_0, q4_1"):
        isq_kind("q4")
    with pytest.raises(ValueError, match="unknown --isq type 'int8'"):
        load_model("/nonexistent", isq="int8")


@pytest.mark.parametrize("isq", ["int4", "fp8"])
def test_int4_fp8_kinds(isq, saved, caplog):
    """The GGUF types' matrices, in groups of 128 (int4) or 128x128 blocks (fp8); rows of 64 and 96 take groups of 64
    and 32, logged; the head and the embeddings stay as stored, as GPTQ/AWQ/FP8 checkpoints keep them."""
    for case, want in (("wide", {"layers.0.wq": 128, "layers.0.w_down": 128}),
                       ("narrow", {"layers.0.wq": 64, "layers.0.w_down": 32})):
        _, folder = saved(case)
        with caplog.at_level(logging.WARNING, logger="ir.isq"):
            model = load_model(folder, progress=False, isq=isq)
        kinds = model.weights.kinds()
        name = "I4_G{}" if isq == "int4" else "F8E4M3_G{}"
        assert {p: kinds[p] for p in want} == {p: name.format(g) for p, g in want.items()}
        mats = [p for p, r in roles(model.graph).items() if r == "matrix"]
        assert len(mats) == 7 and all(kinds[p] != "F32" for p in mats)
        assert all(kinds[p] == "F32" for p in kinds if p not in mats)  # norms, lm_head, embed
    assert f"isq {isq.upper()}: 1 matrix with rows of 96 values (not a whole number of 128-value blocks) fall " \
           f"back to {name.format(32)}:" in caplog.text


def test_cli_flag_reaches_the_engine(saved):
    pytest.importorskip("pydantic")  # the CLI's (the GPU machine has none)
    from frontend import cli

    _, folder = saved("wide")
    args = cli.parse_args(["--w", str(folder), "--isq", "Q4K", "--backend", "mlx", "--mem", "4"])
    engine = cli.engine_spec(args, str(folder)).load()
    kinds = engine.backend.model.weights.kinds()
    assert kinds["layers.0.wq"] == "Q4_K" and kinds["lm_head"] == "Q6_K" and kinds["layers.0.attn_norm"] == "F32"


def _backend(kind: str, model, kept: bool = True):
    """The backend on `model`; `kept`: its matrices must reach it quantized (FP8 is dequantized at load on MLX and
    CPU tensors)."""
    if kind == "mlx":
        from backends.mlx.backend import MLXBackend
        from backends.mlx.weights import QuantLinear

        b = MLXBackend(model, dtype="f32", quantized=True, progress=False)
        assert not kept or any(isinstance(p, QuantLinear) for p in b.params.values()), "no matrix reached MLX as " \
            "affine groups"
        return b
    from backends.cuda.backend import CUDABackend
    from backends.cuda.weights import QuantWeight

    gpu = kind == "cuda-gpu"
    b = CUDABackend(model, device="cuda" if gpu else "cpu", dtype="f32", cuda_graph=False, progress=False)
    assert not kept or any(isinstance(p, QuantWeight) for p in b.params.values()), "no matrix reached CUDA quantized"
    if not gpu:
        b.runner.target = "numpy"  # the DSL's interpreter on CPU tensors
    return b


# On a GPU the quantized GEMVs/GEMMs may take x as int8 per 32 values (llama.cpp's MMQ): ~0.5% of max |logit|
# (tests/test_cuda_kquant_gguf.py), so there only the logits are held, to its 5%. FP8 weights from 9 rows run on x
# quantized to e4m3 per 128 inputs (as vLLM runs FP8 checkpoints): up to 2^-4 of a value, which moves these tiny
# random models' logits by ~12-16% of their largest (0.163 on the H200, 2026-12-04; tests/test_fp8_models.py holds
# its e4m3-activation path to 0.25 likewise).
GPU_TOL = {"fp8": 0.25}
GPU_INT8_TOL = 0.05
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.mark.parametrize("backend", ["mlx", "cuda-cpu", pytest.param("cuda-gpu", marks=needs_gpu)])
@pytest.mark.parametrize("isq", ["q4_0", "q4k", "int4", "fp8"])
def test_backends_match_the_interpreter(backend, isq, saved):
    pytest.importorskip("mlx.core" if backend == "mlx" else "triton")
    _, folder = saved("wide")
    model = load_model(folder, progress=False, isq=isq)
    prompts = _prompts()
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    steps = 2 if backend == "cuda-cpu" else 4  # the DSL's interpreter takes ~3 s a decode step over these GEMVs
    ref_tokens, ref_first = ref.greedy(prompts, steps)
    kept = isq != "fp8" or backend == "cuda-gpu" and torch.cuda.get_device_capability() >= (8, 9)
    tokens, first = backend_greedy(_backend(backend, model, kept), ref, prompts, steps, 8)
    scale = float(np.abs(ref_first).max())
    tol = GPU_TOL.get(isq, GPU_INT8_TOL) if backend == "cuda-gpu" else SAME_WEIGHTS_TOL
    assert float(np.abs(first - ref_first).max()) <= tol * scale
    if backend != "cuda-gpu":
        assert tokens == ref_tokens


@pytest.mark.parametrize("isq", list(FLOAT_TOL))
def test_quantized_model_stays_near_the_float_one(isq, saved):
    _, folder = saved("wide")
    prompts = _prompts()
    _, ours = ReferenceRunner(load_model(folder, progress=False, isq=isq), max_tokens=64).greedy(prompts, 1)
    _, ref = ReferenceRunner(load_model(folder, progress=False), max_tokens=64).greedy(prompts, 1)
    rel = float(np.sqrt(np.mean((ours - ref) ** 2)) / ref.std())
    assert 0 < rel <= FLOAT_TOL[isq], f"{isq}: logits' RMS error {rel:.3f} of their std"


def test_smollm_q8_0_and_fp8_keep_its_greedy_tokens():
    """The default model (a Q4_1 GGUF: dequantized and quantized again) with --isq q8_0 and --isq fp8 through the LLM
    API on MLX, against the file as it is: the same 16 greedy tokens of a chat answer. (int4, RTN over Q4_1's error,
    keeps the first 8: "Paris, France." for "Paris.")"""
    from core.sampling_params import SamplingParams
    from frontend.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(backend="mlx", progress=False, kv_cache_mb=16)
    assert {t.kind for t in plain.backend.model.weights.values()} == {"Q4_1", "Q8_0", "F32"}
    ids = plain.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True)
    want = plain.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(want) == 16
    # fp8 keeps the tied Q8_0 embedding as stored; rows of 576 take groups of 64.
    for isq, kinds in (("q8_0", {"Q8_0", "F32"}), ("fp8", {"F8E4M3_G128", "F8E4M3_G64", "Q8_0", "F32"})):
        llm = LLM(backend="mlx", isq=isq, progress=False, kv_cache_mb=16)
        assert {t.kind for t in llm.backend.model.weights.values()} == kinds
        assert llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == want, isq


# Stored kinds in the MoE model of rows of 64 (exp_gate, wq), 32 (exp_down) and 48 (sh_down) values.
MOE_KINDS = {"q8_0": ("Q8_0", "Q8_0", "Q8_0", "F32"), "int4": ("I4_G64", "I4_G64", "I4_G32", "F32"),
             "fp8": ("F8E4M3_G64", "F8E4M3_G64", "F8E4M3_G32", "F8E4M3_G16")}


@pytest.mark.parametrize("isq", list(MOE_KINDS))
def test_moe_stacks_quantize_and_routers_stay(isq, tmp_path, caplog):
    """Qwen2-MoE (layer 0 dense, a sigmoid-gated shared expert): expert stacks [E, out, in] quantized, the router and
    the shared expert's gate kept as llama-quantize keeps ffn_gate_inp*, the shared down projection (rows of 48) kept
    as stored but by fp8 (groups of 16 in its 128-input block); through MLX against the interpreter on the same
    weights."""
    from tools import check_arch

    cfg = check_arch.hf_config("qwen2_moe", 2)
    cfg.decoder_sparse_step, cfg.norm_topk_prob = 2, False
    random_causal_lm(cfg, 0).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ir.isq"):
        model = load_model(tmp_path, progress=False, isq=isq)
    kinds = model.weights.kinds()
    assert model.weights["layers.1.exp_down"].shape == (8, 64, 32)
    assert tuple(kinds[f"layers.1.{p}"] for p in ("exp_gate", "wq", "exp_down", "sh_down")) == MOE_KINDS[isq]
    assert kinds["layers.1.exp_up"] == kinds["layers.1.sh_gate"] == kinds["layers.1.sh_up"] == MOE_KINDS[isq][0]
    assert kinds["layers.1.router"] == kinds["layers.1.sh_router"] == "F32"
    if isq == "q8_0":
        assert "rows of 48 values (not a whole number of 32-value blocks) stay as stored" in caplog.text
    pytest.importorskip("mlx.core")
    prompts = _prompts()
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    ref_tokens, ref_first = ref.greedy(prompts, 3)
    tokens, first = backend_greedy(_backend("mlx", model, isq != "fp8"), ref, prompts, 3, 8)
    assert float(np.abs(first - ref_first).max()) <= SAME_WEIGHTS_TOL * float(np.abs(ref_first).max())
    assert tokens == ref_tokens
