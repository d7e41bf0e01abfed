"""End-to-end checks of the HF safetensors path: tiny random transformers models, saved with
`save_pretrained`, loaded by `ir.loader.load_model` and run by the numpy reference interpreter.

transformers (eager attention, fp32) is the oracle. Each case exercises one thing the loader or the
graph must get right and that a config default would hide: llama3 rope scaling (with a small
original context so the scaled frequencies are actually used at these positions), q/k/v/o biases and
tied embeddings on llama, mistral's sliding window (shorter than the prompt), qwen2's implied qkv
biases and qwen3's q/k norms.

Tolerance: max|ours - ref| <= 1e-4 * max|ref| over all logits ("1e-4 relative").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_hf import assert_close, hf_greedy, hf_logits, random_causal_lm, random_prompt, saved_models
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
)

from ir.formats.safetensors_file import read_safetensors
from ir.loader import dense_weights, load_model
from ir.reference import ReferenceRunner

torch.set_num_threads(1)

VOCAB, PROMPT_LEN, NEW = 320, 24, 16
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "llama3_rope": (LlamaConfig, dict(rope_parameters=LLAMA3_ROPE)),
    "llama_bias_tied": (LlamaConfig, dict(attention_bias=True, tie_word_embeddings=True)),
    "mistral_window": (MistralConfig, dict(sliding_window=8)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=False)),
    # Not in the main matrix (see test_qwen2_per_layer_window): transformers windows only layers
    # i >= max_window_layers (config.layer_types), here layer 1 of 2.
    "qwen2_swa": (Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Not in the main matrix (test_arch_moe holds the MoE families to transformers): the tensor-parallel tests' MoE,
    # 8 experts of width 32, top 2, a sigmoid-gated shared expert, layer 0 dense (decoder_sparse_step 2).
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                       norm_topk_prob=False)),
    # Not in the main matrix (test_sharding, test_tensor_parallel): head counts the ranks do not divide, split by
    # whole KV groups: 9 query / 3 KV heads (GQA 3, SmolLM2's), 6 / 3 (GQA 2), and MHA with 3 heads, over 2 ranks.
    "gqa9_3": (LlamaConfig, dict(num_attention_heads=9, num_key_value_heads=3, head_dim=8, hidden_size=72)),
    "gqa6_3": (Qwen3Config, dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8, hidden_size=48,
                                 tie_word_embeddings=False)),
    # 6 / 2 over 4 ranks: each KV head replicated on 2 ranks that split its 3 query heads 2 / 1 (Qwen2.5-7B at TP 8)
    "gqa6_2": (LlamaConfig, dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8, hidden_size=48)),
    "mha3": (LlamaConfig, dict(num_attention_heads=3, num_key_value_heads=3, head_dim=16, hidden_size=48,
                               attention_bias=True)),
}
MAIN = ["llama3_rope", "llama_bias_tied", "mistral_window", "qwen2", "qwen3"]


def make_hf(case: str, seed: int = 0) -> torch.nn.Module:
    cls, extra = CASES[case]
    return random_causal_lm(cls(**{**TINY, **extra}), seed)


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return random_prompt(seed, n, VOCAB)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (fp32 HF model, folder with its safetensors save); built once per module."""
    return saved_models(tmp_path_factory, make_hf, load=False)


@pytest.mark.parametrize("case", MAIN)
def test_prompt_logits_and_greedy_match_transformers(case, saved):
    model, folder = saved(case)
    loaded = load_model(folder, progress=False)
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = prompt(1)
    ref = hf_logits(model, ids)
    assert_close(runner.prompt_logits(ids), ref)
    outs, first = runner.greedy([ids], NEW)
    # The first decode step's logits are the prompt's last row.
    assert_close(first[0], ref[-1])
    assert outs[0] == hf_greedy(model, ids, NEW)


@pytest.mark.parametrize("case", MAIN)
def test_varlen_batch_matches_single(case, saved):
    """Three prompts of different lengths decoded together in one flat batch give the tokens each gives
    alone: sequences must not see each other's KV cache or positions."""
    _, folder = saved(case)
    runner = ReferenceRunner(load_model(folder, progress=False), max_tokens=64)
    prompts = [prompt(10, 5), prompt(11, 19), prompt(12, 11)]
    together, _ = runner.greedy(prompts, NEW)
    alone = [runner.greedy([p], NEW)[0][0] for p in prompts]
    assert together == alone


def test_config_flags_reach_the_graph(saved):
    """Guards against the end-to-end tests passing for the wrong reason (e.g. a flag silently unread
    while its weights happen to be ignored)."""
    loaded = {c: load_model(saved(c)[1], progress=False) for c in MAIN}
    cfgs = {c: m.config for c, m in loaded.items()}
    assert cfgs["llama3_rope"].rope.rope_type == "llama3"
    assert cfgs["llama_bias_tied"].qkv_bias and cfgs["llama_bias_tied"].o_bias
    assert cfgs["llama_bias_tied"].tie_word_embeddings
    assert cfgs["mistral_window"].sliding_window == 8
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias and cfgs["qwen2"].sliding_window is None
    assert cfgs["qwen3"].qk_norm and not cfgs["qwen3"].qkv_bias
    # The tied save has no lm_head tensor at all, so the tie path is what is exercised.
    files = saved("llama_bias_tied")[1].glob("*.safetensors")
    assert not any("lm_head.weight" in read_safetensors(f) for f in files)
    assert "lm_head" not in loaded["llama_bias_tied"].graph.params


def test_mistral_window_is_active_in_transformers(saved):
    """The mistral case only tests the window if transformers' eager path applies it at this length:
    the same weights with the window removed must give the same logits inside the first window and
    different ones after it."""
    model, _ = saved("mistral_window")
    ids = prompt(1)
    windowed = hf_logits(model, ids)
    model.config.sliding_window = None
    try:
        full = hf_logits(model, ids)
    finally:
        model.config.sliding_window = 8
    np.testing.assert_allclose(windowed[:8], full[:8], rtol=0, atol=1e-5)
    assert np.abs(windowed[8:] - full[8:]).max() > 1e-2


def test_llama3_scaling_matters(saved):
    """Same for llama3 rope: with original_max_position_embeddings=32 the scaled frequencies change the
    logits at these positions, so matching transformers really checks the scaling."""
    model, _ = saved("llama3_rope")
    ids = prompt(1)
    scaled = hf_logits(model, ids)
    plain = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="eager").eval()
    plain.load_state_dict(model.state_dict())
    assert np.abs(hf_logits(plain, ids) - scaled).max() > 1e-2


@pytest.mark.parametrize("case", ["llama3_rope", "qwen2"])
def test_sharded_save_loads_identically(case, saved, tmp_path):
    model, folder = saved(case)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    one, many = load_model(folder, progress=False), load_model(tmp_path, progress=False)
    a, b = dense_weights(one), dense_weights(many)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    ids = prompt(2)
    np.testing.assert_array_equal(ReferenceRunner(one, 32).prompt_logits(ids),
                                  ReferenceRunner(many, 32).prompt_logits(ids))


@pytest.mark.parametrize("case", MAIN)
def test_bf16_save(case, tmp_path):
    """A bf16 checkpoint: the loader widens the raw bf16 bits; the oracle is transformers in fp32 on
    the same bf16-rounded weights, so the only differences are fp32 rounding. The oracle is a fresh
    fp32 model given the rounded state dict, not `bf16_model.float()`: `.to(torch.bfloat16)` also
    rounds the rope `inv_freq` buffer, and `.float()` does not restore it (logits then differ by
    ~1e-2 at later positions)."""
    bf16 = make_hf(case).to(torch.bfloat16)  # make_hf is deterministic: the fixture's weights
    bf16.save_pretrained(tmp_path)
    rounded = make_hf(case)
    rounded.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    loaded = load_model(tmp_path, progress=False)
    assert {t.kind for t in loaded.weights.values()} == {"BF16"}
    ids = prompt(3)
    assert_close(ReferenceRunner(loaded, 32).prompt_logits(ids), hf_logits(rounded, ids))


def test_qwen2_per_layer_window(saved):
    """qwen2 with use_sliding_window slides only the layers from max_window_layers on (layer_types)."""
    model, folder = saved("qwen2_swa")
    ids = prompt(1)
    assert_close(ReferenceRunner(load_model(folder, progress=False), 64).prompt_logits(ids), hf_logits(model, ids))
