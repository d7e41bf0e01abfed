"""DeepSeek-V2 and -V3 against transformers: multi-head latent attention (low-rank q, a compressed KV latent, the
shared rope key) over a latent cache in the absorbed form, routed experts with shared ones and dense first layers;
V2 with group-limited softmax routing, V3 with grouped sigmoid routing whose correction bias moves the choice (set
here: transformers initializes it to 0, a value that would hide it), and yarn with its mscale on the softmax. Three
prompts in one batch, first-step logits within 1e-4 relative, 16 greedy tokens equal, on the interpreter (plain and
fused graphs) and MLX's CPU build; the CUDA backend on CPU tensors and MLX's compiled decode on fewer tokens. The
cache holds kv_lora_rank + qk_rope_head_dim values a token and layer, as each backend allocates it."""

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


# check_arch's TINY_MLA at 4 heads: the latent (32) and the rope key (8), against the expanded form's per-head keys
# (16 + 8) and values (16).
LATENT, EXPANDED = 32 + 8, 4 * (16 + 8 + 16)


def saved(case: str, path):
    model = hf_model(case)
    model.save_pretrained(path)
    return model, load_model(path, progress=False)


def test_the_cache_holds_one_latent_a_token(tmp_path):
    """Bytes per token and layer of the cache each backend really allocates (f16: 2 bytes an element, the interpreter
    f32), and what the engine sizes pools by, are the latent's: kv_lora_rank + qk_rope_head_dim, far less than the
    expanded layout's per-head keys and values: a quarter here, 1/71 at DeepSeek-V3's sizes (512 + 64 against 128
    heads of 128 + 64 keys and 128 values)."""
    from ir.interpreter import KVCache
    from ir.kv_groups import kv_layout

    _, loaded = saved("deepseek_v2", tmp_path)
    cfg, layers, blocks, bs = loaded.config, loaded.config.num_layers, 6, 4
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == LATENT and 4 * LATENT == EXPANDED
    assert set(kv_layout(loaded.graph).shapes) == {(1, LATENT, cfg.kv_lora_rank, True)}
    cache = KVCache.for_graph(loaded.graph, blocks, bs)
    assert all(v is None for v in cache.v)
    assert sum(k.nbytes for k in cache.k) == layers * blocks * bs * LATENT * 4
    backends = []
    if importlib.util.find_spec("mlx"):
        from backends.mlx.backend import MLXBackend

        backends.append((MLXBackend(loaded, dtype="f16", progress=False), blocks + 1))  # + its scratch block
    if importlib.util.find_spec("triton"):
        from backends.cuda.backend import CUDABackend

        backends.append((CUDABackend(loaded, device="cpu", dtype="f16", progress=False), blocks))
    assert backends, "neither mlx nor triton is installed"
    for backend, allocated in backends:
        backend.allocate_kv(blocks, bs)
        assert backend.kv_bytes_per_block(bs) == layers * bs * LATENT * 2, backend.name
        assert backend.memory().kv_bytes == layers * allocated * bs * LATENT * 2, backend.name
        assert all(len(layer) == 1 for layer in backend.kv), backend.name  # no value tensor beside the latent


def test_absorbed_weights_are_kv_b_projs_rows(tmp_path):
    """W_UK (transposed) and W_UV are each head's K-nope and V rows of transformers' kv_b_proj, bf16 bits moved as
    they are."""
    model = hf_model("deepseek_v2").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    kv_b = model.model.layers[1].self_attn.kv_b_proj.weight.detach().float().numpy().reshape(4, 16 + 16, 32)
    uk, uv = loaded.weights["layers.1.w_uk"], loaded.weights["layers.1.w_uv"]
    assert uk.kind == uv.kind == "BF16" and uk.shape == (4, 32, 16) and uv.shape == (4, 16, 32)
    np.testing.assert_array_equal(uk.values(), kv_b[:, :16].transpose(0, 2, 1))
    np.testing.assert_array_equal(uv.values(), kv_b[:, 16:])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cuda_backend_runs_the_latent_cache(tmp_path):
    """The CUDA backend (CPU tensors here, the H200 in gpu_check): prefill's paged kernels read the latent cache as
    one KV head, keys and values at once, decode steps run mla_decode; ours against transformers as above."""
    from backends.cuda.backend import CUDABackend
    from kernels_src.dsl import launch
    from kernels_src.mla_decode import mla_decode_kernel

    model, loaded = saved("deepseek_v3", tmp_path)
    assert set(CUDABackend(loaded, device="cpu", progress=False).kv_shapes()) == {(1, LATENT, 32, True)}
    prompts = [random_prompt(i, n, model.config.vocab_size) for i, n in ((0, 5), (1, 19))]
    refs = [hf_logits(model, p)[-1] for p in prompts]
    first, tokens = check_arch.run_engine("cuda", loaded, prompts, 4)
    for i, p in enumerate(prompts):
        assert float(np.abs(np.asarray(first[i]) - refs[i]).max()) <= 1e-4 * float(np.abs(refs[i]).max())
        assert tokens[i] == hf_greedy(model, p, 4)
    assert any(k[0] is mla_decode_kernel for k in launch._kernels)  # the decode steps' kernel (compiled once)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_mlx_compiled_decode_runs_the_latent_cache(tmp_path):
    """MLX's compiled decode step, whose inputs and outputs are every layer's caches: one a latent layer."""
    from backends.mlx.backend import MLXBackend
    from ir.reference import ReferenceRunner
    from tools.tiny_hf import backend_greedy

    model, loaded = saved("deepseek_v2", tmp_path)
    backend = MLXBackend(loaded, compile=True, progress=False)
    prompts = [random_prompt(i, n, model.config.vocab_size) for i, n in ((0, 5), (1, 19))]
    tokens, _ = backend_greedy(backend, ReferenceRunner(loaded, max_tokens=32, block_size=4), prompts, 4, 4)
    assert backend.decode is not None and tokens == [hf_greedy(model, p, 4) for p in prompts]


def test_ir_dump_shows_the_latent_cache(tmp_path, capsys):
    from tools import ir_dump

    saved("deepseek_v3", tmp_path)
    assert ir_dump.main([str(tmp_path), "--graph-only"]) == 0
    out = capsys.readouterr().out
    assert f"layers 0-1: latent 1x{LATENT} (values: its first 32) = {LATENT} elements a token and layer" in out
    assert out.count("= latent_attention(") == 2 and out.count("= head_linear(") == 4 and "= attention(" not in out
