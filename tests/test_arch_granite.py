"""Granite against transformers with Granite-3.1-8B's multipliers (tiny shapes), from safetensors and from a GGUF
written as llama.cpp's converter writes it (llama's names, q/k rows permuted, the four granite.*_scale keys)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_write import add_rms_decoder, finish
from test_tiny_gguf import gguf_name, llama_permute
from tiny_hf import assert_close, hf_greedy, hf_logits, random_causal_lm, random_prompt
from transformers import GraniteConfig

from ir.loader import load_model
from ir.reference import ReferenceRunner
from tools.check_arch import shrink

REAL = json.loads((Path(__file__).parent / "data" / "hf_configs" / "granite-3.1-8b-instruct.json").read_text())
SCALES = {k: REAL[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}


@pytest.fixture(scope="module")
def hf():
    return random_causal_lm(shrink(GraniteConfig(**REAL), 2))


def write_gguf(model, path: Path) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "granite")
    add_rms_decoder(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        g, data = gguf_name(name), t.float().numpy()
        if ".attn_q." in g or ".attn_k." in g:
            data = llama_permute(data, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(data))
    finish(w)


def test_the_multipliers_matter(hf):
    """Each of the four changes the logits: matching transformers below checks all of them."""
    ids = random_prompt(1, 20, hf.config.vocab_size)
    ref = hf_logits(hf, ids)
    for key in SCALES:
        plain = random_causal_lm(shrink(GraniteConfig(**{**REAL, key: GraniteConfig().to_dict()[key]}), 2))
        plain.load_state_dict(hf.state_dict())
        assert np.abs(hf_logits(plain, ids) - ref).max() > 1e-2 * np.abs(ref).max(), key


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_granite_matches_transformers(source, hf, tmp_path):
    if source == "gguf":
        path = tmp_path / "granite.gguf"
        write_gguf(hf, path)
    else:
        hf.save_pretrained(tmp_path)
        path = tmp_path
    loaded = load_model(path, progress=False)
    cfg = loaded.config
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == \
        pytest.approx(tuple(SCALES.values()))
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = random_prompt(2, 24, hf.config.vocab_size)
    # Logits are divided by 16: compared before that division, where tiny_hf's "large enough to mean something"
    # check holds (the relative error is the same).
    k = SCALES["logits_scaling"]
    assert_close(runner.prompt_logits(ids) * k, hf_logits(hf, ids) * k)
    assert runner.greedy([ids], 8)[0][0] == hf_greedy(hf, ids, 8)
