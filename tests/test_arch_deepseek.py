"""DeepSeek-V2 and -V3 against transformers: multi-head latent attention (low-rank q, a compressed KV latent, the
shared rope key), routed experts with shared ones and dense first layers; V2 with group-limited softmax routing, V3
with grouped sigmoid routing whose correction bias moves the choice (set here: transformers initializes it to 0, a
value that would hide it), and yarn with its mscale on the softmax. Three prompts in one batch, first-step logits
within 1e-4 relative, 16 greedy tokens equal, on the interpreter (plain and fused graphs) and MLX's CPU build."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from tiny_hf import random_causal_lm, random_prompt
from transformers import AutoConfig

from ir.loader import load_model
from tools import check_arch
from tools.tiny_hf import hf_greedy, hf_logits

ENGINES = ["interp", "fused", *(["mlx"] if importlib.util.find_spec("mlx") else [])]
CASES = {
    "deepseek_v2": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                        n_shared_experts=2, norm_topk_prob=False, first_k_dense_replace=1),
    "deepseek_v3": dict(n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                             mscale_all_dim=1.0, original_max_position_embeddings=16,
                                             beta_fast=32, beta_slow=1)),
    "deepseek_v2_lite": dict(model_type="deepseek_v2", q_lora_rank=None, n_shared_experts=2,
                             first_k_dense_replace=1),  # q projected directly
}


def hf_model(case: str):
    kw = dict(CASES[case])
    cfg = check_arch.shrink(AutoConfig.for_model(kw.pop("model_type", case), **kw), 2)
    if case == "deepseek_v2_lite":
        cfg.q_lora_rank = None
    model = random_causal_lm(cfg, 0)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "gate", None) and getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.5 * torch.randn_like(bias))  # sigmoid scores lie in (0, 1): a bias this size reorders
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_matches_transformers(case, tmp_path):
    model = hf_model(case)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    cfg = loaded.config
    assert cfg.dense_layers == (0,) and cfg.num_experts == 8
    if case == "deepseek_v3":
        assert cfg.scoring == "sigmoid" and cfg.score_bias and cfg.group_score == "top2_sum" and cfg.attn_scale > 0.21
        assert float(np.abs(loaded.weights["layers.1.router_bias"].values()).max()) > 0.1
    else:
        assert cfg.scoring == "softmax" and not cfg.score_bias and (cfg.q_lora_rank == 0) == (case.endswith("lite"))
    prompts = [random_prompt(i, n, model.config.vocab_size) for i, n in enumerate(check_arch.PROMPT_LENS)]
    refs = [hf_logits(model, p)[-1] for p in prompts]
    ref_tokens = [hf_greedy(model, p, 16) for p in prompts]
    for engine in ENGINES:
        first, tokens = check_arch.run_engine(engine, loaded, prompts, 16)
        for i in range(len(prompts)):
            err = float(np.abs(np.asarray(first[i]) - refs[i]).max()) / float(np.abs(refs[i]).max())
            assert err <= 1e-4 and float(np.abs(refs[i]).max()) > 1.0, (engine, i, err)
            assert tokens[i] == ref_tokens[i], (engine, i)


def test_group_routing_differs_from_plain_top_k():
    """The groups matter on these weights: routing without them chooses other experts (so matching transformers
    above checks the group rule), and V3's bias moves the choice but not the weights."""
    from ir.interpreter import moe_route

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 8)).astype(np.float32)
    bias = (0.05 * rng.standard_normal(8)).astype(np.float32)
    grouped = moe_route(logits, bias, top_k=2, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum")
    plain = moe_route(logits, bias, top_k=2, scoring="sigmoid")
    unbiased = moe_route(logits, top_k=2, scoring="sigmoid")
    assert (np.sort(grouped[1]) != np.sort(plain[1])).any(axis=1).sum() > 5
    assert (np.sort(plain[1]) != np.sort(unbiased[1])).any(axis=1).sum() > 5
    scores = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(plain[0], np.take_along_axis(scores, plain[1], -1), rtol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cuda_backend_caches_values_at_the_keys_width(tmp_path):
    """MLA's expanded form on the CUDA backend (CPU tensors here, the H200 in gpu_check): values (16 wide) cached at
    the keys' width (24), the DSL's kernels taking one head width; ours against transformers as above."""
    from backends.cuda.backend import CUDABackend

    model = hf_model("deepseek_v3")
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert set(CUDABackend(loaded, device="cpu", progress=False).kv_shapes()) == {(4, 24, 24)}
    prompts = [random_prompt(i, n, model.config.vocab_size) for i, n in ((0, 5), (1, 19))]
    refs = [hf_logits(model, p)[-1] for p in prompts]
    first, tokens = check_arch.run_engine("cuda", loaded, prompts, 4)
    for i, p in enumerate(prompts):
        assert float(np.abs(np.asarray(first[i]) - refs[i]).max()) <= 1e-4 * float(np.abs(refs[i]).max())
        assert tokens[i] == hf_greedy(model, p, 4)
