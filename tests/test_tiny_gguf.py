"""End-to-end checks of the GGUF path: tiny GGUF files written with gguf-py's GGUFWriter the way
llama.cpp's convert_hf_to_gguf.py would write them, loaded by `ir.loader.load_model`.

The files hold F32 norms and biases and a mix of F32, F16 and Q8_0 matrices (the embedding among
them), the metadata keys llama.cpp reads, and, for llama only, q/k rows permuted for ggml's
interleaved rope (LlamaModel.permute), which our loader must undo.

The oracle is transformers loading the very same file (`from_pretrained(..., gguf_file=...)`): it
dequantizes with gguf-py and undoes the llama permutation itself, so both sides see the same weights
and agree to fp32 rounding. Tolerance: max|ours - ref| <= 1e-4 * max|ref| ("1e-4 relative").
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_write import MIX, TypeCycle, add_rms_decoder, add_tensor, finish
from tiny_hf import assert_close, hf_logits, random_causal_lm, random_prompt
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from ir.loader import load_model
from ir.reference import ReferenceRunner

torch.set_num_threads(1)

VOCAB, PROMPT_LEN, NEW = 288, 24, 16
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None)

# case -> (HF config class, overrides, GGUF general.architecture)
CASES = {
    "llama": (LlamaConfig, {}, "llama"),
    # Tied: the file has no output.weight, and both loaders must reuse token_embd.weight. This file
    # also has no qwen2.vocab_size key but a gpt2-style token list (as many llama.cpp files do), so
    # the vocabulary size must come from the token count.
    "qwen2_tied": (Qwen2Config, dict(tie_word_embeddings=True), "qwen2"),
    # head_dim 32 != hidden / heads = 16, so attention.key_length must be read (as for Qwen3-0.6B,
    # whose head_dim 128 != 1024 / 16).
    "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=False), "qwen3"),
    # llama with q/k/v/o biases: llama.cpp's llama graph adds them when present, and the converter
    # permutes the q/k biases like the weights. transformers' GGUF config reader has no attention_bias
    # key (it would drop the biases), so this case is only checked against the rounded HF model.
    "llama_bias": (LlamaConfig, dict(attention_bias=True), "llama"),
}
TRANSFORMERS_CASES = ["llama", "qwen2_tied", "qwen3"]
# transformers 5.24 maps attention.key_length to head_dim only for qwen3_moe, not qwen3, so a qwen3
# GGUF gets Qwen3Config's default head_dim 128 and mis-shaped weights. Only that value is supplied.
REF_CONFIG = {"qwen3": dict(head_dim=32)}
# Matrices cycle through gguf_write.MIX in state-dict order, starting at the case's index, so the embedding
# (the first matrix) is F32 for llama, F16 for the tied qwen2 (its output layer too) and Q8_0 for qwen3.

# HF tensor name -> GGUF tensor name (llama.cpp's tensor_mapping for these architectures).
RENAMES = [
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.", r"blk.\1."),
    (r"input_layernorm\.", "attn_norm."),
    (r"post_attention_layernorm\.", "ffn_norm."),
    (r"self_attn\.([qkv])_proj\.", r"attn_\1."),
    (r"self_attn\.o_proj\.", "attn_output."),
    (r"self_attn\.([qk])_norm\.", r"attn_\1_norm."),
    (r"mlp\.(gate|up|down)_proj\.", r"ffn_\1."),
]


def gguf_name(hf: str) -> str:
    for pat, rep in RENAMES:
        hf = re.sub(pat, rep, hf)
    return hf


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (called with n_head_kv for k): rows of each head
    go from HF's [first halves | second halves] order to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_gpt2_vocab(w: gguf.GGUFWriter, n: int) -> None:
    """A minimal byte-level BPE vocabulary: the 256 byte symbols, then n - 256 two-letter merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(a, b) for a in letters for b in letters][: n - len(symbols)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(symbols + [a + b for a, b in pairs])
    w.add_token_types([1] * n)
    w.add_token_merges([f"{a} {b}" for a, b in pairs])


def make_hf(case: str, seed: int = 0) -> torch.nn.Module:
    cls, extra, _ = CASES[case]
    return random_causal_lm(cls(**{**TINY, **extra}), seed)


def write_gguf(case: str, model: torch.nn.Module, path: Path) -> dict[str, Q]:
    """Write `model` as a GGUF file; returns the type given to each tensor."""
    cfg, arch = model.config, CASES[case][2]
    w = gguf.GGUFWriter(str(path), arch)
    add_rms_decoder(w, cfg)
    w.add_rope_dimension_count(cfg.head_dim)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "qwen2":
        add_gpt2_vocab(w, cfg.vocab_size)
    else:
        w.add_vocab_size(cfg.vocab_size)
    kinds: dict[str, Q] = {}
    tied = cfg.tie_word_embeddings
    cycle = TypeCycle(start=list(CASES).index(case))
    for hf, t in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        name, data = gguf_name(hf), t.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = llama_permute(data, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        kinds[name] = add_tensor(w, name, data, cycle(data))
    finish(w)
    return kinds


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (GGUF path, tensor kinds, source HF model); written once per module."""
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
            model = make_hf(case)
            cache[case] = (path, write_gguf(case, model, path), model)
        return cache[case]

    return get


def transformers_from_gguf(case: str, path: Path) -> torch.nn.Module:
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                               attn_implementation="eager", **REF_CONFIG.get(case, {}))
    ref.generation_config.eos_token_id = None
    return ref.eval()


def rounded_hf(case: str, model: torch.nn.Module, kinds: dict[str, Q]) -> torch.nn.Module:
    """The source model with each weight rounded through its file type (F16 cast, Q8_0 quantize and
    dequantize with gguf-py). Rounded in HF row order: Q8_0 blocks run along rows, so the llama q/k
    row permutation commutes with quantization and the file's values are exactly these, permuted."""
    out = make_hf(case)
    state = {}
    for hf, t in model.state_dict().items():
        name = "token_embd.weight" if hf == "lm_head.weight" and "output.weight" not in kinds else gguf_name(hf)
        x = t.numpy()
        if kinds[name] == Q.F16:
            x = x.astype(np.float16).astype(np.float32)
        elif kinds[name] == Q.Q8_0:
            x = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)
        state[hf] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    out.load_state_dict(state)
    return out


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return random_prompt(seed, n, VOCAB)


@pytest.mark.parametrize("case", TRANSFORMERS_CASES)
def test_gguf_matches_transformers(case, files):
    """Prompt logits and 16 greedy tokens against transformers reading the same file."""
    path, kinds, _ = files(case)
    assert set(kinds.values()) == {Q.F32, Q.F16, Q.Q8_0}
    assert kinds["token_embd.weight"] == MIX[list(CASES).index(case)]
    ref = transformers_from_gguf(case, path)
    runner = ReferenceRunner(load_model(path, progress=False), max_tokens=64)
    ids = prompt(1)
    assert_close(runner.prompt_logits(ids), hf_logits(ref, ids))
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert runner.greedy([ids], NEW)[0][0] == out[0, len(ids):].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_rounded_hf(case, files):
    """An oracle independent of transformers' GGUF reader: the HF model the file was written from, with
    its weights rounded as the file rounds them. Also checks that prompts batched together agree with
    each alone on a file with quantized weights."""
    path, kinds, model = files(case)
    runner = ReferenceRunner(load_model(path, progress=False), max_tokens=64)
    ids = prompt(2)
    assert_close(runner.prompt_logits(ids), hf_logits(rounded_hf(case, model, kinds), ids))
    prompts = [prompt(10, 7), prompt(11, 20), prompt(12, 3)]
    assert runner.greedy(prompts, 8)[0] == [runner.greedy([p], 8)[0][0] for p in prompts]


@pytest.mark.parametrize("case", TRANSFORMERS_CASES)
def test_gguf_config_and_types(case, files):
    """The loader reads the hyper-parameters from metadata and keeps quantized tensors quantized."""
    path, kinds, _ = files(case)
    loaded = load_model(path, progress=False)
    cfg = loaded.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (VOCAB, 64, 2, 4, 2)
    assert cfg.head_dim == CASES[case][1].get("head_dim", 16)
    assert cfg.tie_word_embeddings == ("output.weight" not in kinds)
    assert cfg.qkv_bias == (case == "qwen2_tied") and cfg.qk_norm == (case == "qwen3")
    stored = {loaded.sources[p]: t.kind for p, t in loaded.weights.items()}
    assert stored == {name: k.name for name, k in kinds.items()}
