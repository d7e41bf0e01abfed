"""Helpers shared by the tiny-model tests: random transformers models with telling weights and their logits (from
tools/tiny_hf, which tools/check_arch shares), and the closeness check used against them."""

from __future__ import annotations

import numpy as np

from tools.tiny_hf import hf_greedy, hf_logits, random_causal_lm, random_prompt

__all__ = ["assert_close", "hf_greedy", "hf_logits", "random_causal_lm", "random_prompt"]


def assert_close(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-4) -> None:
    """max|ours - ref| <= rtol * max|ref|, on logits large enough for that to mean something."""
    assert ours.shape == ref.shape
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert scale > 1.0, f"reference logits are nearly zero (max {scale}); the test would prove little"
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol:g} * max|ref| {scale:.3g}"
