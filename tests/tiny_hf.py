"""Helpers shared by the tiny-model tests: random transformers models with telling weights and their logits (from
tools/tiny_hf, which tools/check_arch shares), and the closeness check used against them."""

from __future__ import annotations

import numpy as np

from tools.tiny_hf import hf_greedy, hf_logits, random_causal_lm, random_prompt

__all__ = ["assert_close", "hf_greedy", "hf_logits", "random_causal_lm", "random_prompt", "saved_models"]


def assert_close(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-4) -> None:
    """max|ours - ref| <= rtol * max|ref|, on logits large enough for that to mean something."""
    assert ours.shape == ref.shape
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert scale > 1.0, f"reference logits are nearly zero (max {scale}); the test would prove little"
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol:g} * max|ref| {scale:.3g}"


def saved_models(tmp_path_factory, make_hf, load: bool = False):
    """For a module fixture: case -> (fp32 HF model from make_hf(case), its save_pretrained folder[, our model loaded
    from it]), each built once."""
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            model, folder = make_hf(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(folder)
            if load:
                from ir.loader import load_model

                cache[case] = (model, folder, load_model(folder, progress=False))
            else:
                cache[case] = (model, folder)
        return cache[case]

    return get


def save_tiny_chat_qwen3(folder, tokenizer_path) -> None:
    """A tiny random Qwen3 with a real tokenizer and chat template (SmolLM2's, from `tokenizer_path`'s GGUF, written
    as a tokenizer.json folder) saved in `folder`: enough for the server's and the CLI's chat paths."""
    import json

    from transformers import Qwen3Config

    from ir.loader import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    cfg = Qwen3Config(vocab_size=tok.backend.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=True)
    random_causal_lm(cfg).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    specials = {k: v for k, v in tok.special_tokens.items() if v}
    (folder / "tokenizer_config.json").write_text(json.dumps({**specials, "chat_template": tok.chat_template}))
