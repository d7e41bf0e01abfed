"""Helpers shared by the tiny-model tests: random transformers models with telling weights, their
logits, and the closeness check used against them."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def random_causal_lm(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A random fp32 model whose weights are large enough that attention is far from uniform and the
    logits spread over several units (the default init of std 0.02 gives near-zero logits, where a
    wrong rope or mask would hardly show)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:  # a matrix: unit-variance outputs, a bit more for q/k to sharpen attention
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_close(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-4) -> None:
    """max|ours - ref| <= rtol * max|ref|, on logits large enough for that to mean something."""
    assert ours.shape == ref.shape
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert scale > 1.0, f"reference logits are nearly zero (max {scale}); the test would prove little"
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol:g} * max|ref| {scale:.3g}"


def random_prompt(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()
