"""The DeepSeek-V2-Lite synthetic GGUF (tools/synth_gguf_deepseek.py) and bench_gguf's plumbing for it, without a GPU.

A tiny file (3 layers, layer 0 dense, hidden 64, 8 experts top 3 beside 2 shared, MLA with a 32-wide latent, V2-Lite's
yarn) is read three ways: by gguf-py's reader (llama.cpp's own Python package: names in its deepseek2 tensor table,
ggml's dimension order as src/models/deepseek2.cpp creates the tensors, the converter's keys), by our loader (config
and every tensor bound), and by transformers' DeepseekV2 with a tiny config built from the same shape over
V2-Lite's config.json: transformers cannot read a deepseek2 GGUF, so the file's tensors are put back into its
state dict as the converter's mapping runs backwards (attn_k_b and attn_v_b joined again into kv_b_proj), and our
interpreter's logits must match its. The file then runs through the engine the bench's ours stage builds (MLX's CPU
build) against the interpreter's greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import fields, replace

import gguf
import numpy as np
import pytest
import torch
from synth_gguf_checks import bench_engine_matches_interpreter, tensors_as_llama_cpp_reads_them
from test_arch_deepseek_gguf import RENAMES, TOP, check_against
from transformers import AutoConfig, AutoModelForCausalLM

from ir.formats.gguf_file import GGUFFile
from ir.loader import load_model
from tools import bench_gguf, bench_gguf_report, synth_gguf
from tools.synth_gguf_deepseek import DeepseekV2LiteShape

TINY = DeepseekV2LiteShape(vocab=512, hidden=64, intermediate=96, expert_intermediate=32, experts=8, top_k=3,
                           heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, layers=3)
STD = 0.25  # logits spread over several units: a wrong tensor shows
# rope 16 wide: its frequencies span yarn's ramp at V2-Lite's factor and betas, so each of its keys changes the logits
REAL = json.loads((synth_gguf.REPO / "tests/data/hf_configs/deepseek-v2-lite.json").read_text())
F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


def hf_config(s: DeepseekV2LiteShape) -> dict:
    """V2-Lite's config.json with the shape's hyper-parameters: what the converter would read to write this file."""
    rope = dict(REAL["rope_scaling"], factor=s.yarn_factor, original_max_position_embeddings=s.yarn_original_context,
                beta_fast=s.yarn_beta_fast, beta_slow=s.yarn_beta_slow, mscale=s.mscale_all_dim,
                mscale_all_dim=s.mscale_all_dim)
    return REAL | dict(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        moe_intermediate_size=s.expert_intermediate, n_routed_experts=s.experts, num_experts_per_tok=s.top_k,
        n_shared_experts=s.shared_experts, first_k_dense_replace=s.dense_layers, num_attention_heads=s.heads,
        num_key_value_heads=s.heads, kv_lora_rank=s.kv_lora_rank, qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim, num_hidden_layers=s.layers,
        rope_theta=s.rope_theta, max_position_embeddings=s.context, rms_norm_eps=s.rms_eps,
        routed_scaling_factor=s.routed_scaling, rope_scaling=rope)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv2") / "tiny-deepseek2.gguf"
    return synth_gguf.write_model(path, TINY, None, std=STD, seed=5, device="cpu", progress=False)


def test_deepseek2_file_as_llama_cpp_reads_it(tiny_file):
    r, dims, types = tensors_as_llama_cpp_reads_them(tiny_file, gguf.MODEL_ARCH.DEEPSEEK2, "deepseek2")
    # as deepseek2.cpp creates them: wq {n_embd, n_head * k_mla}, wkv_a_mqa {n_embd, rank + rope},
    # wk_b {nope, rank, n_head}, wv_b {rank, v_mla, n_head}, wo {n_head * v_mla, n_embd}, ...
    assert dims["blk.0.attn_q.weight"] == (64, 4 * 32) and dims["blk.0.attn_kv_a_mqa.weight"] == (64, 48)
    assert dims["blk.0.attn_k_b.weight"] == (16, 32, 4) and dims["blk.0.attn_v_b.weight"] == (32, 16, 4)
    assert dims["blk.0.attn_output.weight"] == (64, 64) and dims["blk.0.attn_kv_a_norm.weight"] == (32,)
    # layer 0 dense (n_ff), the rest routed {n_embd, n_ff_exp, n_expert} and shared {n_embd, n_ff_exp * n_shared}
    assert dims["blk.0.ffn_gate.weight"] == (64, 96) and dims["blk.0.ffn_down.weight"] == (96, 64)
    assert not any(n.startswith("blk.0.") and ("_exps" in n or "_shexp" in n or "gate_inp" in n) for n in dims)
    assert dims["blk.1.ffn_gate_exps.weight"] == dims["blk.2.ffn_up_exps.weight"] == (64, 32, 8)
    assert dims["blk.1.ffn_down_exps.weight"] == (32, 64, 8) and dims["blk.1.ffn_gate_inp.weight"] == (64, 8)
    assert dims["blk.1.ffn_up_shexp.weight"] == (64, 64) and dims["blk.1.ffn_down_shexp.weight"] == (64, 64)
    assert not any(n.startswith("blk.1.ffn_") and n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down") for n in dims)
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.attn_kv_a_norm.weight"] == F32
    assert types["blk.1.attn_k_b.weight"] == types["blk.1.ffn_down_exps.weight"] == F16
    want = {"block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
            "attention.head_count_kv": 1, "leading_dense_block_count": 1, "attention.q_lora_rank": 0,
            "attention.kv_lora_rank": 32, "attention.key_length": 48, "attention.value_length": 32,
            "attention.key_length_mla": 32, "attention.value_length_mla": 16, "expert_feed_forward_length": 32,
            "expert_count": 8, "expert_used_count": 3, "expert_shared_count": 2, "expert_group_count": 1,
            "expert_group_used_count": 1, "expert_gating_func": 1, "rope.dimension_count": 16,
            "rope.scaling.original_context_length": 4096, "context_length": 163840, "vocab_size": 512}
    assert {k: int(r.fields[f"deepseek2.{k}"].contents()) for k in want} == want
    floats = {"rope.freq_base": 1e4, "rope.scaling.factor": 40.0, "rope.scaling.yarn_beta_fast": 32.0,
              "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 0.0707,
              "expert_weights_scale": 1.0, "attention.layer_norm_rms_epsilon": 1e-6}
    for k, v in floats.items():
        assert r.fields[f"deepseek2.{k}"].contents() == pytest.approx(v, rel=1e-6), k
    assert r.fields["deepseek2.rope.scaling.type"].contents() == "yarn"
    assert "deepseek2.expert_weights_norm" not in r.fields  # norm_topk_prob false: the converter writes no key
    assert synth_gguf.file_bytes(TINY) == sum(int(t.n_bytes) for t in r.tensors)


def test_lite_layer_counts_keep_the_converters_keys(tmp_path):
    """At 26 or 27 layers llama.cpp knows a lite file without q_lora_rank, and the file says none, as the converter's;
    at any other count it says 0, which llama.cpp requires there."""
    for layers, has in ((27, False), (26, False), (12, True)):
        w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "deepseek2")
        replace(TINY, layers=layers).add_arch_metadata(w)
        assert ("deepseek2.attention.q_lora_rank" in w.kv_data[0]) == has, layers


def test_deepseek2_file_loads_with_its_config(tiny_file):
    m = load_model(tiny_file, progress=False)
    c = m.config
    assert m.arch.name == "deepseek_v2" and c.scoring == "softmax" and not c.norm_topk_prob and not c.score_bias
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
            c.qk_rope_head_dim, c.v_head_dim, c.num_experts, c.top_k, c.moe_intermediate_size, c.n_shared_experts,
            c.dense_layers, c.routed_scaling, c.n_group) == (
        512, 64, 3, 4, 0, 32, 16, 16, 16, 8, 3, 32, 2, (0,), 1.0, 1)
    scaling = dict(c.rope.scaling)
    assert c.rope.style == "interleaved" and scaling["rope_type"] == "yarn" and scaling["factor"] == 40.0
    assert scaling["mscale_all_dim"] == pytest.approx(0.707, rel=1e-6)
    mscale = 0.1 * 0.707 * np.log(40.0) + 1
    assert c.attn_scale == pytest.approx(32 ** -0.5 * mscale ** 2, rel=1e-6)
    assert set(m.sources.values()) == set(GGUFFile(tiny_file).tensors)  # every tensor bound, none missing
    assert m.sources["layers.1.w_uk"] == "blk.1.attn_k_b.weight" and m.weights["layers.1.exp_down"].kind == "F16"


def hf_state(path, cfg) -> dict[str, torch.Tensor]:
    """transformers' state dict from the file's tensors (gguf-py's reader), the converter's mapping backwards."""
    back, top = {v: k for k, v in RENAMES.items()}, {v: k for k, v in TOP.items()}
    t = {x.name: np.array(x.data, dtype=np.float32) for x in gguf.GGUFReader(path).tensors}
    out = {top[n]: x for n, x in t.items() if n in top}
    for i in range(cfg.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        k_b, v_b = t.pop(b + "attn_k_b.weight"), t.pop(b + "attn_v_b.weight")  # [heads, rank, nope], [heads, v, rank]
        out[p + "self_attn.kv_b_proj.weight"] = np.concatenate([k_b.transpose(0, 2, 1), v_b], 1).reshape(
            -1, cfg.kv_lora_rank)
        if b + "ffn_gate_exps.weight" in t:
            out[p + "mlp.experts.gate_up_proj"] = np.concatenate([t.pop(b + "ffn_gate_exps.weight"),
                                                                  t.pop(b + "ffn_up_exps.weight")], 1)
            out[p + "mlp.experts.down_proj"] = t.pop(b + "ffn_down_exps.weight")
        for n in [n for n in t if n.startswith(b)]:
            _, _, part, suffix = n.split(".")
            out[f"{p}{back[part]}.{suffix}"] = t[n]
    return {k: torch.from_numpy(v) for k, v in out.items()}


def test_deepseek2_file_matches_transformers(tiny_file):
    cfg = AutoConfig.for_model(**hf_config(TINY))
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.q_lora_rank is None
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict(hf_state(tiny_file, cfg), strict=True)
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    check_against(model, load_model(tiny_file, progress=False))


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_deepseek2_file_through_the_bench_engine(tiny_file):
    """The engine bench_gguf's ours stage builds (engine_over), over MLX's CPU backend, against the interpreter."""
    bench_engine_matches_interpreter(tiny_file, TINY.vocab)


def test_deepseek_v2_lite_defaults_and_disk():
    """The checkpoint's config.json but for the vocabulary (the llama-bpe vocab file's) and the layers (the disk)."""
    s = synth_gguf.SHAPES["deepseek-v2-lite"]
    ours = hf_config(s)
    assert {k for k in REAL if ours[k] != REAL[k]} == {"vocab_size", "num_hidden_layers"}
    assert {f.name for f in fields(s)} - {"vocab", "layers"} <= {"hidden", "intermediate", "expert_intermediate",
                                                                  "experts", "top_k", "shared_experts", "dense_layers",
                                                                  "heads", "kv_lora_rank", "qk_nope_head_dim",
                                                                  "qk_rope_head_dim", "v_head_dim", "rope_theta",
                                                                  "context", "rms_eps", "routed_scaling",
                                                                  "yarn_factor", "yarn_original_context",
                                                                  "yarn_beta_fast", "yarn_beta_slow", "mscale_all_dim"}
    assert s.vocab == 128256 and s.layers == 12 < REAL["num_hidden_layers"]
    assert 13.5e9 < synth_gguf.file_bytes(s) < 14.5e9
    assert synth_gguf.file_bytes(replace(s, layers=27)) > 31e9  # why not 27: a third of the disk for F16 alone


def test_bench_plumbing_for_the_deepseek_shape(tiny_file, tmp_path):
    args = bench_gguf.parse_args(["--stage", "report", "--shape", "deepseek-v2-lite", "--dir", str(tmp_path)])
    assert (args.files, args.what, synth_gguf.shape_from_args(args).layers) == (["f16", "q4km"],
                                                                                ["decode", "prefill"], 12)
    keys = {f.key for f in bench_gguf.plan(args.files, args.what, args.batches, args.contexts)}
    assert {"f16 decode b1 c128", "f16 decode b16 c128", "q4km decode b64 c128", "f16 prefill 2048",
            "q4km prefill 2048"} <= keys
    assert bench_gguf.gguf_name("deepseek-v2-lite", "q4km") == "deepseek-v2-lite-q4_k_m.gguf"
    assert synth_gguf.shape_from_args(bench_gguf.parse_args(["--stage", "report", "--shape", "deepseek-v2-lite",
                                                             "--kv-lora-rank", "256"])).kv_lora_rank == 256

    info = bench_gguf.file_info(tiny_file)
    f = GGUFFile(tiny_file)
    parts = info["bytes_by_part"]
    nbytes = {n: t.data.nbytes for n, t in f.tensors.items()}
    assert parts["routed experts"] == info["expert_bytes"] == sum(v for n, v in nbytes.items() if "_exps." in n)
    assert parts["shared experts"] == sum(v for n, v in nbytes.items() if "_shexp." in n)
    assert parts["attention"] == sum(v for n, v in nbytes.items() if ".attn_" in n)
    assert "embedding" not in parts and sum(parts.values()) == info["read_bytes"] == sum(nbytes.values()) - nbytes[
        "token_embd.weight"]
    # the latent cache: [latent | rope key] a token and layer in f16, not K and V of every head
    assert info["kv_bytes_per_token"] == 3 * (32 + 16) * 2
    assert (info["experts"], info["top_k"], info["layers"]) == (8, 3, 3)
    # batch 1 reads 3 of 8 routed experts' bytes and everything else (shared experts, attention, layer 0) in full
    dense = info["read_bytes"] - info["expert_bytes"]
    assert bench_gguf_report.step_weight_bytes(info, 1) == pytest.approx(dense + info["expert_bytes"] * 3 / 8)
    results = {"env": {"copy_gbs": 4000.0, "shape": "deepseek-v2-lite"}, "files": {"f16": info}, "stages": [],
               "errors": [], "figures": {"f16 decode b16 c128": {"file": "f16", "kind": "decode", "batch": 16,
                                                                 "context": 128, "ours": {"tok_s": 1.0, "time": "t"}}}}
    kv = 16 * (128 + bench_gguf.GEN / 2) * info["kv_bytes_per_token"]
    weights = dense + info["expert_bytes"] * (1 - (5 / 8) ** 16)
    assert bench_gguf_report.rows(results)[0]["roofline"] == pytest.approx(16 * 4000e9 / (weights + kv))
    bench_gguf_report.write_report(results, tmp_path, shape="deepseek-v2-lite")
    md = (tmp_path / "report-deepseek-v2-lite.md").read_text()
    assert "deepseek2, 3 layers, 8 experts, top 3" in md and "shared experts 0." in md and "KiB a token" in md
