"""A tiny random llama that speaks through SmolLM2's real tokenizer and chat template, saved as a Hugging
Face folder, and a Hugging Face cache laid out around it: fast enough to serve thousands of requests."""

from __future__ import annotations

import os
from pathlib import Path

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-chat"
GGUF_REPO = "tiny-org/smollm2-gguf"


def save_tiny_chat_model(folder: Path, smollm_path: Path, max_len: int = 256) -> Path:
    from transformers import AutoTokenizer, LlamaConfig

    from tests.tiny_hf import random_causal_lm

    tok = AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    random_causal_lm(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def hub_cache(root: Path, smollm_path: Path) -> Path:
    """A Hugging Face cache (the layout huggingface_hub reads offline) holding REPO and GGUF_REPO."""
    for repo, fill in ((REPO, lambda snap: save_tiny_chat_model(snap, smollm_path)),
                       (GGUF_REPO, lambda snap: os.symlink(smollm_path, snap / smollm_path.name))):
        base = root / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / SNAPSHOT
        snap.mkdir(parents=True)
        fill(snap)
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text(SNAPSHOT)
    return root
