"""A tiny random Qwen3 embedding model saved as Qwen3-Embedding is: the bare decoder (Qwen3Model's tensor names, no
lm_head) with sentence-transformers' modules.json and 1_Pooling/config.json; and transformers' embeddings of it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tools.tiny_hf import random_causal_lm

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def save_tiny_embedding_qwen3(folder: Path, mode: str = "last", normalize: bool = True, vocab: int = 512,
                              config: dict | None = None, tokenizer_path=None):
    """Writes the model into `folder` and returns transformers' Qwen3Model (fp32) with the same weights. `config`
    adds keys to config.json (is_matryoshka, ...); `tokenizer_path` (a GGUF) gives it that file's tokenizer."""
    from transformers import Qwen3Config

    tok = None
    if tokenizer_path is not None:
        from ir.loader import load_tokenizer

        tok = load_tokenizer(tokenizer_path)
        vocab = tok.backend.get_vocab_size()
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    decoder = random_causal_lm(cfg).model  # no lm_head: what an embedding model ships
    decoder.save_pretrained(folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pool = {"word_embedding_dimension": cfg.hidden_size, **{key: m == mode for m, key in _MODES.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    if tok is not None:
        tok.backend.save(str(folder / "tokenizer.json"))
    return decoder


def hf_embedding(decoder, ids: list[int], mode: str = "last", normalize: bool = True) -> np.ndarray:
    """sentence-transformers' pooling of Qwen3Model's last hidden state (its final norm's output), in torch."""
    import torch

    with torch.no_grad():
        h = decoder(torch.tensor([ids])).last_hidden_state[0]
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
        if normalize:
            v = torch.nn.functional.normalize(v, dim=0)
    return v.numpy()
