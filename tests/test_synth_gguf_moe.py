"""The Qwen3-MoE synthetic GGUF (tools/synth_gguf_moe.py) and bench_gguf's plumbing for it, without a GPU.

A tiny file (2 layers, hidden 64, 4 experts top 2) is read three ways: by gguf-py's reader (llama.cpp's own Python
package: names in its qwen3moe tensor table, ggml's dimension order), by our loader (config and every tensor bound),
and by transformers' GGUF loader, whose logits our interpreter's must match: transformers un-stacks the experts and
maps the names itself, so agreement says the file is laid out as llama.cpp's converter lays it out. The file then
runs through the engine the bench's ours stage builds (MLX's CPU build) against the interpreter's greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from synth_gguf_checks import bench_engine_matches_interpreter, tensors_as_llama_cpp_reads_them
from tiny_hf import assert_close, random_prompt

from ir.formats.gguf_file import GGUFFile
from ir.loader import load_model
from ir.reference import ReferenceRunner
from tools import bench_gguf, bench_gguf_report, synth_gguf
from tools.synth_gguf_moe import Qwen3MoEShape

TINY = Qwen3MoEShape(vocab=512, hidden=64, intermediate=96, expert_intermediate=32, experts=4, top_k=2, heads=4,
                     kv_heads=2, head_dim=16, layers=2)
STD = 0.25  # logits spread over several units: a wrong tensor shows


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf"
    return synth_gguf.write_model(path, TINY, None, std=STD, seed=5, device="cpu", progress=False)


def test_qwen3moe_file_as_llama_cpp_reads_it(tiny_file):
    r, dims, types = tensors_as_llama_cpp_reads_them(tiny_file, gguf.MODEL_ARCH.QWEN3MOE, "qwen3moe")
    # the converter keeps norms and routers in F32
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.1.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.F16
    # as src/models/qwen3moe.cpp creates them: {n_embd, n_ff_exp, n_expert}, {n_ff_exp, n_embd, n_expert}, ...
    assert dims["blk.1.ffn_gate_exps.weight"] == dims["blk.1.ffn_up_exps.weight"] == (64, 32, 4)
    assert dims["blk.1.ffn_down_exps.weight"] == (32, 64, 4) and dims["blk.1.ffn_gate_inp.weight"] == (64, 4)
    assert dims["blk.0.attn_q_norm.weight"] == dims["blk.0.attn_k_norm.weight"] == (16,)
    assert dims["blk.0.attn_q.weight"] == (64, 64) and dims["blk.0.attn_k.weight"] == (64, 32)
    want = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "expert_feed_forward_length": 32,
            "expert_count": 4, "expert_used_count": 2, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.key_length": 16, "attention.value_length": 16, "context_length": 40960, "vocab_size": 512}
    assert {k: int(r.fields[f"qwen3moe.{k}"].contents()) for k in want} == want
    assert r.fields["qwen3moe.rope.freq_base"].contents() == 1e6
    assert synth_gguf.file_bytes(TINY) == sum(int(t.n_bytes) for t in r.tensors)


def test_qwen3moe_file_loads_with_its_config(tiny_file):
    m = load_model(tiny_file, progress=False)
    c = m.config
    assert m.arch.name == "qwen3_moe" and c.qk_norm and c.norm_topk_prob and c.dense_layers == ()
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.num_experts,
            c.top_k, c.moe_intermediate_size, c.rope.theta, c.rope.style) == (512, 64, 2, 4, 2, 16, 4, 2, 32, 1e6,
                                                                              "neox")
    assert set(m.sources.values()) == set(GGUFFile(tiny_file).tensors)  # every tensor bound, none missing
    assert m.weights["layers.1.exp_down"].shape == (4, 64, 32) and m.weights["layers.1.exp_gate"].kind == "F16"


def test_qwen3moe_file_matches_transformers(tiny_file):
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' GGUF config table has no qwen3moe.expert_feed_forward_length (it would take the default 768):
    # the one key given by hand; everything else, tensors included, it reads itself.
    cfg = AutoConfig.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name)
    cfg.moe_intermediate_size = TINY.expert_intermediate
    ref = AutoModelForCausalLM.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name, config=cfg,
                                               dtype=torch.float32, attn_implementation="eager").eval()
    assert (ref.config.num_experts, ref.config.num_experts_per_tok, ref.config.norm_topk_prob) == (4, 2, True)
    ids = random_prompt(7, 11, TINY.vocab)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(want).max() > 1  # random weights that give logits worth comparing
    assert_close(ReferenceRunner(load_model(tiny_file, progress=False), max_tokens=32).prompt_logits(ids), want)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_qwen3moe_file_through_the_bench_engine(tiny_file):
    """The engine bench_gguf's ours stage builds (engine_over), over MLX's CPU backend, against the interpreter."""
    bench_engine_matches_interpreter(tiny_file, TINY.vocab)


def test_qwen3_30b_a3b_defaults_and_disk():
    """The checkpoint's shape but for the vocabulary (the llama-bpe vocab file's) and the layers (the 64 GB disk)."""
    hf = json.loads((bench_gguf.synth_gguf.REPO / "tests/data/hf_configs/qwen3-30b-a3b.json").read_text())
    s = synth_gguf.SHAPES["qwen3-30b-a3b"]
    assert (s.hidden, s.intermediate, s.expert_intermediate, s.experts, s.top_k, s.heads, s.kv_heads, s.head_dim,
            s.rope_theta, s.context, s.rms_eps) == (
        hf["hidden_size"], hf["intermediate_size"], hf["moe_intermediate_size"], hf["num_experts"],
        hf["num_experts_per_tok"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
        hf["rope_theta"], hf["max_position_embeddings"], hf["rms_norm_eps"])
    assert s.vocab == synth_gguf.LlamaShape().vocab == 128256 and s.layers == 16 < hf["num_hidden_layers"]
    assert 19e9 < synth_gguf.file_bytes(s) < 23e9
    assert synth_gguf.file_bytes(Qwen3MoEShape(layers=48)) > 58e9  # why not 48: the machine's whole disk


def test_bench_plumbing_for_the_moe_shape(tiny_file, tmp_path):
    args = bench_gguf.parse_args(["--stage", "report", "--shape", "qwen3-30b-a3b", "--dir", str(tmp_path)])
    assert (args.files, args.what, synth_gguf.shape_from_args(args).layers) == (["f16", "q4km"],
                                                                                ["decode", "prefill"], 16)
    keys = {f.key for f in bench_gguf.plan(args.files, args.what, args.batches, args.contexts)}
    assert {"f16 decode b1 c128", "f16 decode b64 c128", "q4km decode b1 c128", "q4km decode b64 c128",
            "f16 prefill 2048", "q4km prefill 2048"} <= keys
    assert bench_gguf.gguf_name("qwen3-30b-a3b", "q4km") == "qwen3-30b-a3b-q4_k_m.gguf"
    assert bench_gguf.gguf_name("llama3-8b", "q4km") == "model-q4_k_m.gguf"  # the 8B's files keep their names
    with pytest.raises(SystemExit, match="experts"):
        synth_gguf.shape_from_args(bench_gguf.parse_args(["--stage", "report", "--experts", "8"]))

    info = bench_gguf.file_info(tiny_file)
    exps = sum(t.data.nbytes for n, t in GGUFFile(tiny_file).tensors.items() if "_exps." in n)
    assert (info["experts"], info["top_k"], info["layers"], info["expert_bytes"]) == (4, 2, 2, exps)
    # batch 1 reads half of the experts (2 of 4); batch 64 nearly all of them
    dense = info["read_bytes"] - exps
    assert bench_gguf_report.step_weight_bytes(info, 1) == pytest.approx(dense + exps / 2)
    assert bench_gguf_report.step_weight_bytes(info, 64) == pytest.approx(info["read_bytes"])
    results = {"env": {"copy_gbs": 4000.0, "shape": "qwen3-30b-a3b"}, "files": {"f16": info}, "stages": [],
               "errors": [], "figures": {"f16 decode b1 c128": {"file": "f16", "kind": "decode", "batch": 1,
                                                                "context": 128, "ours": {"tok_s": 1.0, "time": "t"}}}}
    kv = (128 + bench_gguf.GEN / 2) * info["kv_bytes_per_token"]
    row = bench_gguf_report.rows(results)[0]
    assert row["roofline"] == pytest.approx(4000e9 / (dense + exps / 2 + kv))
    written = bench_gguf_report.write_report(results, tmp_path, shape="qwen3-30b-a3b")
    md = (tmp_path / "report-qwen3-30b-a3b.md").read_text()
    assert written[0].name == "report-qwen3-30b-a3b.md" and "qwen3moe, 2 layers, 4 experts, top 2" in md
