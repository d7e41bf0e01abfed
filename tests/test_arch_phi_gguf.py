"""phi and phi3 from GGUF files written as llama.cpp's converter writes them (phi2 with separate and with fused
q/k/v, phi3 with longrope factor tensors and a window), against the HF model they were written from, rounded as
the file rounds it (the HF tiny models and their cases are test_arch_phi.py's)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_write import TypeCycle, add_tensor, finish
from test_arch_phi import _check, hf_generate, make_hf, prompt, saved  # noqa: F401  (saved: a fixture)
from tiny_hf import assert_close, hf_logits

from ir.loader import load_model
from ir.reference import ReferenceRunner
from ir.rope import inv_freq

RENAMES = {
    "model.embed_tokens.": "token_embd.", "model.final_layernorm.": "output_norm.", "model.norm.": "output_norm.",
    "lm_head.": "output.", "input_layernorm.": "attn_norm.", "post_attention_layernorm.": "ffn_norm.",
    "self_attn.q_proj.": "attn_q.", "self_attn.k_proj.": "attn_k.", "self_attn.v_proj.": "attn_v.",
    "self_attn.qkv_proj.": "attn_qkv.", "self_attn.dense.": "attn_output.", "self_attn.o_proj.": "attn_output.",
    "mlp.fc1.": "ffn_up.", "mlp.gate_up_proj.": "ffn_up.", "mlp.fc2.": "ffn_down.", "mlp.down_proj.": "ffn_down.",
}
GGUF_CASES = {"phi2": False, "phi2_fused_qkv": True, "phi3_longrope": False, "phi3_swa": False}  # -> fuse q/k/v


def gguf_tensors(model: torch.nn.Module, fuse_qkv: bool) -> dict[str, list[str]]:
    """GGUF name -> the HF tensors it holds, in row order (an old mixformer phi-2 conversion fuses q/k/v)."""
    out: dict[str, list[str]] = {}
    for hf in model.state_dict():
        if model.config.tie_word_embeddings and hf == "lm_head.weight":
            continue
        name = hf.replace("model.layers.", "blk.")
        for a, b in RENAMES.items():
            name = name.replace(a, b)
        if fuse_qkv:
            name = name.replace(".attn_q.", ".attn_qkv.").replace(".attn_k.", ".attn_qkv.")
            name = name.replace(".attn_v.", ".attn_qkv.")
        out.setdefault(name, []).append(hf)
    return out


def write_gguf(model: torch.nn.Module, path: Path, fuse_qkv: bool) -> dict[str, Q]:
    """convert_hf_to_gguf.py's Phi2Model / Phi3MiniModel metadata and tensors; returns each tensor's type."""
    cfg = model.config
    phi3 = cfg.model_type == "phi3"
    rope = cfg.rope_parameters
    rot = int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "phi3" if phi3 else "phi2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size if phi3 else 4 * cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads if phi3 else cfg.num_attention_heads)
    w.add_rope_dimension_count(rot)
    w.add_vocab_size(cfg.vocab_size)
    if phi3:
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
    else:
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    if rope.get("long_factor"):
        orig = cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(cfg.max_position_embeddings / orig) / np.log(orig))))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    state, kinds, cycle = model.state_dict(), {}, TypeCycle()
    for name, parts in gguf_tensors(model, fuse_qkv).items():
        data = np.concatenate([state[p].float().numpy() for p in parts])
        kinds[name] = add_tensor(w, name, data, cycle(data))
    finish(w)
    return kinds


def rounded_hf(case: str, model: torch.nn.Module, kinds: dict[str, Q], fuse_qkv: bool) -> torch.nn.Module:
    """The source model with each weight rounded through its file type (Q8_0 blocks run along rows, so rounding
    each part of a fused tensor alone gives the fused tensor's values)."""
    kind_of = {hf: kinds[name] for name, parts in gguf_tensors(model, fuse_qkv).items() for hf in parts}
    state = {}
    for hf, t in model.state_dict().items():
        x = t.numpy()
        kind = kind_of.get(hf, kinds.get("token_embd.weight"))  # a tied lm_head is the embedding
        if kind == Q.F16:
            x = x.astype(np.float16).astype(np.float32)
        elif kind == Q.Q8_0:
            x = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)
        state[hf] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    out = make_hf(case)
    out.load_state_dict(state)
    return out


@pytest.fixture(scope="module")
def gguf_files(saved, tmp_path_factory):  # noqa: F811
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            fuse = GGUF_CASES[case]
            model = saved(case.replace("_fused_qkv", ""))[0]
            path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
            kinds = write_gguf(model, path, fuse)
            cache[case] = (path, kinds, rounded_hf(case.replace("_fused_qkv", ""), model, kinds, fuse))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_matches_rounded_hf(case, gguf_files, saved):  # noqa: F811
    path, kinds, ref = gguf_files(case)
    assert set(kinds.values()) == {Q.F32, Q.F16, Q.Q8_0}
    loaded = load_model(path, progress=False)
    hf_cfg = saved(case.replace("_fused_qkv", ""))[2].config
    for field in ("sliding_window", "tie_word_embeddings", "num_kv_heads", "intermediate_size", "hidden_act"):
        assert getattr(loaded.config, field) == getattr(hf_cfg, field), field
    ours, theirs = loaded.config.rope, hf_cfg.rope  # the file's factors are f32, as transformers' tables are
    assert (ours.rope_type, ours.rotary_dim, ours.theta) == (theirs.rope_type, theirs.rotary_dim, theirs.theta)
    for long in (False, True) if ours.rope_type == "longrope" else (False,):
        np.testing.assert_allclose(inv_freq(ours, long)[0], inv_freq(theirs, long)[0], rtol=1e-7)
        assert inv_freq(ours, long)[1] == pytest.approx(inv_freq(theirs, long)[1], rel=1e-6)
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = prompt(2)
    assert_close(runner.prompt_logits(ids), hf_logits(ref, ids))
    assert runner.greedy([ids], 8)[0][0] == hf_generate(ref, ids, 8)


def test_gguf_phi3_quantized_on_mlx(gguf_files):
    """The longrope GGUF, its Q8_0 fused tensors split by rows, kept quantized (MLX affine groups) on MLX, where the
    fusion pass joins them again."""
    pytest.importorskip("mlx")
    from backends.mlx.backend import MLXBackend
    from backends.mlx.weights import QuantLinear

    loaded = load_model(gguf_files("phi3_longrope")[0], progress=False)
    backend = MLXBackend(loaded, quantized=True, progress=False)
    kept = {p for p, w in backend.params.items() if isinstance(w, QuantLinear)}
    assert "layers.0.wq+wk+wv" in kept  # the Q8_0 parts (this file's layer-0 gate_up is F32)
    _check(backend, loaded, [prompt(1), prompt(2, 15)], 4)
