"""Mixture-of-experts decoders against transformers: Mixtral, Qwen2-MoE (a sigmoid-gated shared expert, a dense
layer off the sparse step, weights not renormalized) and Qwen3-MoE (q/k norms, a dense layer listed in
mlp_only_layers, weights renormalized). Tiny random models built by transformers from each config (tools/check_arch:
three prompts in one batch, first-step logits within 1e-4 relative, 16 greedy tokens equal) on the interpreter (plain
and fused graphs), MLX's CPU build and the CUDA backend on CPU tensors; and from GGUF files written as llama.cpp's
converter writes them (expert stacks ffn_*_exps, Mixtral as "llama" with an expert count and q/k rows permuted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_write import add_rms_decoder, add_tensor, finish
from safetensors.numpy import load_file
from test_tiny_gguf import add_gpt2_vocab, gguf_name, llama_permute
from tiny_hf import assert_close, hf_greedy, hf_logits, random_causal_lm, random_prompt

from ir.loader import load_model
from ir.reference import ReferenceRunner
from tools import check_arch

HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
ENGINES = ["interp", "fused", *(["mlx"] if HAS_MLX else []), *(["cuda"] if HAS_TRITON else [])]

# Features on top of check_arch's tiny shapes (8 experts, top 2, expert width 32, shared expert 48).
CASES = {
    "mixtral": dict(model_type="mixtral", sliding_window=None),
    "qwen2_moe": dict(model_type="qwen2_moe", decoder_sparse_step=2, norm_topk_prob=False),  # layer 0 dense
    "qwen3_moe": dict(model_type="qwen3_moe", mlp_only_layers=[0], norm_topk_prob=True),
}


def config_file(case: str, tmp_path: Path) -> Path:
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps(CASES[case]))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_transformers_on_every_engine(case, tmp_path):
    # CUDA on CPU tensors (Triton's interpreter) for the case with every feature (shared expert, a dense layer);
    # on a GPU for all three
    gpu = HAS_TRITON and __import__("torch").cuda.is_available()
    engines = [e for e in ENGINES if e != "cuda" or gpu or case == "qwen2_moe"]
    rows = check_arch.check(str(config_file(case, tmp_path)), engines, new=16)
    assert {r.engine for r in rows} == set(engines) and len(rows) == 3 * len(engines)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_configs_read_their_layers_and_routing(tmp_path):
    from ir.models import by_name

    def ours(case):
        hf = check_arch.hf_config(str(config_file(case, tmp_path)), 2).to_dict()
        return by_name(case).config_from_hf(hf)

    m, q2, q3 = ours("mixtral"), ours("qwen2_moe"), ours("qwen3_moe")
    assert (m.num_experts, m.top_k, m.moe_intermediate_size, m.norm_topk_prob, m.dense_layers) == (8, 2, 128, True, ())
    assert (q2.dense_layers, q2.shared_expert_intermediate_size, q2.norm_topk_prob, q2.qkv_bias) == ((0,), 48, False,
                                                                                                     True)
    assert (q3.dense_layers, q3.shared_expert_intermediate_size, q3.norm_topk_prob, q3.qk_norm) == ((0,), 0, True, True)


# --- GGUF -------------------------------------------------------------------------------------------------------

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
EXPERT = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def write_gguf(case: str, model, folder: Path, path: Path, experts: Q) -> None:
    """llama.cpp's layout: per-expert HF tensors (as save_pretrained writes them) stacked as ffn_{gate,up,down}_exps,
    the router ffn_gate_inp, the shared expert *_shexp with its gate a vector ffn_gate_inp_shexp; `experts` is the
    stacks' type."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[case])
    add_rms_decoder(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_local_experts if case == "mixtral" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if case != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if case == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_gpt2_vocab(w, cfg.vocab_size)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, data in load_file(str(folder / "model.safetensors")).items():
        data = data.astype(np.float32)
        parts = name.split(".")
        if ".experts." in name:  # model.layers.{i}.(mlp|block_sparse_moe).experts.{e}.{w}.weight
            layer, e, kind = parts[2], int(parts[5]), EXPERT[parts[6]]
            stacks.setdefault(f"blk.{layer}.ffn_{kind}_exps.weight", {})[e] = data
            continue
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            g = f"blk.{parts[2]}.ffn_gate_inp.weight"
        elif ".shared_expert_gate." in name:
            g, data = f"blk.{parts[2]}.ffn_gate_inp_shexp.weight", data.reshape(-1)
        elif ".shared_expert." in name:
            g = f"blk.{parts[2]}.ffn_{EXPERT[parts[5]]}_shexp.weight"
        else:
            g = gguf_name(name)
        if case == "mixtral" and (".attn_q." in g or ".attn_k." in g):
            data = llama_permute(data, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        add_tensor(w, g, data)
    for g, by_expert in stacks.items():
        add_tensor(w, g, np.stack([by_expert[e] for e in sorted(by_expert)]), experts)
    finish(w)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            folder = tmp_path_factory.mktemp(case)
            cfg = check_arch.hf_config(str(config_file(case, folder)), 2)
            model = random_causal_lm(cfg, 0)
            model.save_pretrained(folder)
            cache[case] = (model, folder)
        return cache[case]

    return get


@pytest.mark.parametrize("experts", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_moe_matches_transformers(case, experts, hf_models, tmp_path):
    model, folder = hf_models(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(case, model, folder, path, experts)
    loaded = load_model(path, progress=False)
    assert loaded.arch.name == case
    assert loaded.weights["layers.1.exp_gate"].shape == (8, 32 if case != "mixtral" else 128, 64)
    assert loaded.weights["layers.1.exp_gate"].kind == experts.name
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = random_prompt(3, 21, model.config.vocab_size)
    # Q8_0 experts round each weight to 1 part in 254 of its block's largest: a looser bound, still far below what a
    # wrong expert, router or permutation gives.
    assert_close(runner.prompt_logits(ids), hf_logits(model, ids), rtol=1e-4 if experts == Q.F32 else 3e-2)
    if experts == Q.F32:
        assert runner.greedy([ids], 8)[0][0] == hf_greedy(model, ids, 8)


@pytest.mark.skipif(not HAS_MLX, reason="mlx is not installed")
def test_gguf_q8_0_experts_stay_quantized_on_mlx(hf_models, tmp_path):
    """Q8_0 expert stacks as MLX affine groups through gather_qmm, against the interpreter on the same file."""
    from backends.mlx.backend import MLXBackend
    from backends.mlx.weights import QuantLinear
    from tools.tiny_hf import backend_greedy

    model, folder = hf_models("qwen3_moe")
    path = tmp_path / "q3.gguf"
    write_gguf("qwen3_moe", model, folder, path, Q.Q8_0)
    loaded = load_model(path, progress=False)
    backend = MLXBackend(loaded, quantized=True, progress=False)
    assert isinstance(backend.params["layers.1.exp_down"], QuantLinear)
    prompts = [random_prompt(i, n, model.config.vocab_size) for i, n in ((4, 7), (5, 12))]
    ref = ReferenceRunner(loaded, max_tokens=64, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 4)
    tokens, first = backend_greedy(backend, ref, prompts, 4, 4)
    assert_close(first, ref_first)  # Q8_0 blocks are exactly 8-bit affine groups of 32
    assert tokens == ref_tokens


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gguf_q8_0_experts_on_cuda_backend(device, hf_models, tmp_path):
    """Q8_0 expert stacks stay quantized on the CUDA backend (CPU tensors, and a GPU where there is one): the fused
    MoE over their GGUF blocks, against the interpreter on the same file. On a GPU the decode steps replay CUDA
    graphs, which the grouping on the device allows."""
    import torch

    from backends.cuda.backend import CUDABackend
    from backends.cuda.weights import QuantWeight
    from tools.tiny_hf import backend_greedy

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, folder = hf_models("qwen2_moe")
    path = tmp_path / "q2.gguf"
    write_gguf("qwen2_moe", model, folder, path, Q.Q8_0)
    loaded = load_model(path, progress=False)
    backend = CUDABackend(loaded, device=device, dtype="f32", progress=False)
    assert isinstance(backend.params["layers.1.exp_gate"], QuantWeight)
    if device == "cpu":  # the kernels on the DSL's interpreter: Triton's took 62 s over the MoE GEMVs' programs (their
        backend.runner.target = "numpy"  # Triton lowering has its interpreter tests in tests/test_kernels_moe_gemv.py)
    prompts = [random_prompt(6, 5, model.config.vocab_size)]
    ref = ReferenceRunner(loaded, max_tokens=64, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 2)
    tokens, first = backend_greedy(backend, ref, prompts, 2, 4)
    assert_close(first, ref_first)
    assert tokens == ref_tokens
    if device == "cuda":
        assert backend.use_graphs and backend.graphs is not None
        assert backend.graphs.graphs and not backend.graphs.failed, backend.graphs.failed
