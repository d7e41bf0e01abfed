"""Tiny random models the 8-bit KV cache tests of both backends share (tests/test_mlx_kv_int8.py,
tests/test_cuda_kv_int8.py): head dims of 32 (one int8 group) unless the case says otherwise."""

from __future__ import annotations

from test_tiny_models import TINY
from tiny_hf import random_causal_lm
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from ir.loader import LoadedModel, load_model
from tools import check_arch


def tiny_model(case: str, folder) -> LoadedModel:
    """"llama" (GQA, head dim 32), "llama16" (head dim 16), "qwen2_swa" (layer 1 windowed: two KV groups) or
    "deepseek_v2" (MLA, a latent of 24 + 8), saved to `folder` and loaded."""
    if case == "deepseek_v2":
        cfg = check_arch.shrink(AutoConfig.for_model("deepseek_v2", first_k_dense_replace=1), 2)
        cfg.kv_lora_rank = 24
    elif case == "qwen2_swa":
        cfg = Qwen2Config(**{**TINY, "head_dim": 32}, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                          tie_word_embeddings=False)
    else:
        cfg = LlamaConfig(**{**TINY, "head_dim": 32 if case == "llama" else 16})
    random_causal_lm(cfg, 0).save_pretrained(folder)
    return load_model(folder, progress=False)
