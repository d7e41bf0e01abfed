"""DeepSeek-V2 / V3 from GGUF files written as llama.cpp's converter writes them ("deepseek2": MLA as an MQA view in
key/value_length with the heads' widths under the _mla keys, kv_b_proj split per head into attn_k_b (transposed) and
attn_v_b, or an older file's attn_kv_b; expert stacks, exp_probs_b, yarn's log multiplier as 0.1 * mscale_all_dim),
against transformers on the weights the file holds (test_arch_deepseek's tiny models): prompt logits within 1e-4
relative, greedy tokens equal, on the interpreter; MLX's CPU build and the CUDA backend on CPU tensors on one file
each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_write import add_tensor, finish
from test_arch_deepseek import hf_model
from test_tiny_gguf import add_gpt2_vocab
from tiny_hf import assert_close, hf_greedy, hf_logits, random_prompt

from ir.loader import load_model
from ir.models import by_name
from ir.reference import ReferenceRunner
from ir.rope import inv_freq

HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None

RENAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def make_hf(case: str) -> torch.nn.Module:
    model = hf_model(case)
    if case == "deepseek_v2_lite":  # greedy routing: the converter writes n_group whatever topk_method says, so
        model.config.n_group = model.config.topk_group = 1  # the file holds V2-Lite's own 1 (transformers ignores it)
    if case == "deepseek_v2":
        # One group of four: with two of four (the shared tiny shape) and top 2, a group scored by its best expert
        # always holds one of the top two, so groups would change nothing and a wrong group rule would pass.
        model.config.topk_group = 1
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.topk_group = 1
    return model


def gguf_tensors(model: torch.nn.Module, split_kv: bool, fused_gate_up: bool = False) -> dict[str, np.ndarray]:
    """llama.cpp's name -> fp32 array (numpy order: GGUF's ne reversed), from transformers' state dict; expert gate
    and up stacks apart, or as one ffn_gate_up_exps (gate rows first), which llama.cpp also reads."""
    cfg, out = model.config, {}
    nope, vd = cfg.qk_nope_head_dim, cfg.v_head_dim
    for name, t in model.state_dict().items():
        x = t.float().numpy()
        if name in TOP:
            out[TOP[name]] = x
            continue
        _, _, i, rest = name.split(".", 3)  # model.layers.{i}.<rest>
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj" and fused_gate_up:
            out[blk + "ffn_gate_up_exps.weight"] = x
        elif rest == "mlp.experts.gate_up_proj":  # transformers 5's stacks [experts, gate | up, hidden]
            f = x.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = x[:, :f], x[:, f:]
        elif rest == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = x
        elif rest == "mlp.gate.e_score_correction_bias":
            out[blk + "exp_probs_b.bias"] = x
        elif rest == "self_attn.kv_b_proj.weight" and split_kv:
            # convert_hf_to_gguf's DeepseekV2Model: per head [nope | v] rows, k_b transposed to [heads, rank, nope]
            kv_b = x.reshape(cfg.num_attention_heads, nope + vd, -1)
            out[blk + "attn_k_b.weight"] = kv_b[:, :nope].transpose(0, 2, 1)
            out[blk + "attn_v_b.weight"] = kv_b[:, nope:]
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"{blk}{RENAMES[module]}.{suffix}"] = x
    return out


def write_gguf(model: torch.nn.Module, path: Path, split_kv: bool, types: dict[str, Q] | None = None,
               fused_gate_up: bool = False) -> None:
    """The metadata convert_hf_to_gguf writes for deepseek2 (newer files with split_kv, older ones without: the
    heads' widths then in key/value_length), every tensor F32 unless `types` names it."""
    cfg, types = model.config, types or {}
    w = gguf.GGUFWriter(str(path), "deepseek2")
    rank, rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # MLA as MQA
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    v3 = cfg.model_type == "deepseek_v3"
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    # DeepSeek's config.json says scoring_func (V2 softmax, V3 sigmoid); transformers' configs drop it
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    if split_kv:
        w.add_key_length(rank + rope_dim)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + rope_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + rope_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    add_gpt2_vocab(w, cfg.vocab_size)
    for name, x in gguf_tensors(model, split_kv, fused_gate_up).items():
        add_tensor(w, name, x, types.get(name, Q.F32))
    finish(w)


def check_against(model, loaded, new: int = 8) -> None:
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = random_prompt(3, 21, model.config.vocab_size)
    assert_close(runner.prompt_logits(ids), hf_logits(model, ids))
    assert runner.greedy([ids], new)[0][0] == hf_greedy(model, ids, new)


# case -> (whether the file stores attn_k_b / attn_v_b, else attn_kv_b as older conversions do; ffn_gate_up_exps)
CASES = {"deepseek_v2": (False, False), "deepseek_v3": (True, False), "deepseek_v2_lite": (True, True)}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_deepseek_matches_transformers(case, tmp_path):
    """F32 files against transformers; the config read from the metadata is the one read from config.json."""
    model = make_hf(case)
    split_kv, fused = CASES[case]
    write_gguf(model, tmp_path / "m.gguf", split_kv, fused_gate_up=fused)
    loaded = load_model(tmp_path / "m.gguf", progress=False)
    assert loaded.arch.name == model.config.model_type
    ours, hf = loaded.config, by_name(loaded.arch.name).config_from_hf(model.config.to_dict())
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim",
                  "num_experts", "top_k", "moe_intermediate_size", "n_shared_experts", "dense_layers", "scoring",
                  "n_group", "topk_group", "group_score", "norm_topk_prob", "score_bias", "intermediate_size"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.routed_scaling == pytest.approx(hf.routed_scaling, rel=1e-6)
    assert ours.attn_scale == pytest.approx(hf.attn_scale, rel=1e-6) and ours.rope.style == hf.rope.style
    for a, b in zip(inv_freq(ours.rope), inv_freq(hf.rope), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    if case == "deepseek_v3":  # yarn's mscale reached the softmax, and the bias the router
        assert ours.attn_scale > 1.05 * (24 ** -0.5) and ours.rope.rope_type == "yarn"
        assert float(np.abs(loaded.weights["layers.1.router_bias"].values()).max()) > 0.1
    assert loaded.sources["layers.1.exp_up"] == f"blk.1.ffn_{'gate_up' if fused else 'up'}_exps.weight"
    check_against(model, loaded)


def test_split_k_b_v_b_load_like_kv_b(tmp_path):
    """attn_k_b / attn_v_b (newer files) give the very W_UK^T and W_UV that splitting attn_kv_b gives, F16 bits as
    stored; so both files give the same logits."""
    model = make_hf("deepseek_v2")
    loaded = {}
    for split in (False, True):
        types = {n: Q.F16 for n in ("blk.1.attn_kv_b.weight", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight")}
        write_gguf(model, tmp_path / f"{split}.gguf", split, types)
        loaded[split] = load_model(tmp_path / f"{split}.gguf", progress=False)
    for key in ("w_uk", "w_uv"):
        a, b = loaded[False].weights[f"layers.1.{key}"], loaded[True].weights[f"layers.1.{key}"]
        assert a.kind == b.kind == "F16" and a.shape == b.shape
        np.testing.assert_array_equal(a.values(), b.values())
    assert "attn_kv_b" in loaded[False].sources["layers.1.w_uk"]
    assert loaded[True].sources["layers.1.w_uv"] == "blk.1.attn_v_b.weight"
    ids = random_prompt(4, 13, model.config.vocab_size)
    logits = [ReferenceRunner(m, max_tokens=32).prompt_logits(ids) for m in loaded.values()]
    np.testing.assert_array_equal(logits[0], logits[1])


def rounded(model: torch.nn.Module, types: dict[str, Q]) -> torch.nn.Module:
    """`model` with each tensor `types` names rounded as the file stores it, by gguf-py's own quantize and dequantize
    (blocks of 32 along each row: an attn_v_b row is a kv_b_proj row's V part, an expert stack row an expert's)."""
    cfg, state = model.config, {k: v.clone() for k, v in model.state_dict().items()}
    hf_name = {v: k for k, v in RENAMES.items()}
    heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim

    def r(x: torch.Tensor, kind: Q) -> torch.Tensor:
        x = x.numpy()
        y = x.astype(np.float16) if kind == Q.F16 else gguf.quants.dequantize(gguf.quants.quantize(x, kind), kind)
        return torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32).reshape(x.shape))

    for name, kind in types.items():
        _, i, part, _ = name.split(".")
        base = f"model.layers.{i}."
        if part == "attn_v_b":
            kv_b = state[base + "self_attn.kv_b_proj.weight"].reshape(heads, -1, cfg.kv_lora_rank)
            kv_b[:, nope:] = r(kv_b[:, nope:].contiguous(), kind)
        elif part in ("ffn_gate_exps", "ffn_up_exps"):
            fused, f = state[base + "mlp.experts.gate_up_proj"], cfg.moe_intermediate_size
            half = slice(0, f) if part == "ffn_gate_exps" else slice(f, 2 * f)
            fused[:, half] = r(fused[:, half].contiguous(), kind)
        else:
            key = base + ("mlp.experts.down_proj" if part == "ffn_down_exps" else hf_name[part] + ".weight")
            state[key] = r(state[key], kind)
    out = make_hf(cfg.model_type)
    out.load_state_dict(state)
    return out


MIXED = {"blk.1.attn_v_b.weight": Q.Q8_0, "blk.1.ffn_gate_exps.weight": Q.Q8_0, "blk.1.ffn_down_exps.weight": Q.F16,
         "blk.1.ffn_up_exps.weight": Q.Q8_0, "blk.1.attn_kv_a_mqa.weight": Q.Q8_0, "blk.1.attn_output.weight": Q.F16,
         "blk.1.attn_q_b.weight": Q.F16, "blk.1.ffn_up_shexp.weight": Q.Q8_0}


@pytest.fixture(scope="module")
def mixed_v3(tmp_path_factory):
    model = make_hf("deepseek_v3")
    path = tmp_path_factory.mktemp("mixed") / "v3.gguf"
    write_gguf(model, path, True, MIXED)
    loaded = load_model(path, progress=False)
    return rounded(model, MIXED), loaded


def test_gguf_quantized_matrices(mixed_v3):
    """F16 and Q8_0 matrices (expert stacks among them) stay as stored; a Q8_0 attn_v_b is decoded to F32 at load
    (head_linear takes dense weights); against transformers on the rounded weights, as tight as F32."""
    model, loaded = mixed_v3
    w = loaded.weights
    assert w["layers.1.w_uv"].kind == "F32" and w["layers.1.w_uv"].shape == (4, 16, 32)
    assert w["layers.1.exp_gate"].kind == w["layers.1.exp_up"].kind == "Q8_0" and w["layers.1.exp_down"].kind == "F16"
    assert w["layers.1.kv_a"].kind == "Q8_0" and w["layers.1.q_b"].kind == "F16"
    check_against(model, loaded)


@pytest.mark.skipif(not HAS_MLX, reason="mlx is not installed")
def test_gguf_deepseek_on_mlx(mixed_v3):
    from backends.mlx.backend import MLXBackend
    from tools.tiny_hf import backend_greedy

    model, loaded = mixed_v3
    prompts = [random_prompt(i, n, model.config.vocab_size) for i, n in ((7, 5), (8, 17))]
    tokens, first = backend_greedy(MLXBackend(loaded, progress=False),
                                   ReferenceRunner(loaded, max_tokens=32, block_size=4), prompts, 4, 4)
    for p, f, t in zip(prompts, first, tokens, strict=True):
        assert_close(np.asarray(f), hf_logits(model, p)[-1])
        assert t == hf_greedy(model, p, 4)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gguf_deepseek_on_cuda_backend(mixed_v3):
    """CPU tensors (the DSL's interpreter): the file's F16 and Q8_0 matrices and Q8_0 stacks (the fused MoE's GGUF
    passes) in one prefill step; test_arch_deepseek runs the latent cache's decode steps, which nothing here changes,
    and each step costs seconds under the interpreter."""
    from backends.cuda.backend import CUDABackend
    from tools.tiny_hf import backend_greedy

    model, loaded = mixed_v3
    prompts = [random_prompt(9, 5, model.config.vocab_size)]
    backend = CUDABackend(loaded, device="cpu", dtype="f32", progress=False)
    backend.runner.target = "numpy"  # the DSL's interpreter: Triton's spends ~20 s in the MoE GEMVs' programs
    tokens, first = backend_greedy(backend, ReferenceRunner(loaded, max_tokens=32, block_size=4), prompts, 1, 4)
    assert_close(np.asarray(first[0]), hf_logits(model, prompts[0])[-1])
    assert tokens[0] == hf_greedy(model, prompts[0], 1)
