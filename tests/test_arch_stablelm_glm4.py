"""stablelm and GLM-4 (glm4, glm) end to end: tiny random transformers models saved with `save_pretrained`, and tiny
GGUF files written from them the way llama.cpp's convert_hf_to_gguf.py writes these architectures, run through the
reference interpreter, the MLX backend and the CUDA backend (CPU tensors here; the GPU where there is one).

transformers (eager attention, fp32) is the oracle: prompt logits within 1e-4 relative (tiny_hf.assert_close) and
greedy tokens equal. What the cases cover, each a layout of a real checkpoint:
- stablelm_qk_norm_parallel (StableLM-2-12B): per-head q/k LayerNorms, the parallel residual (no ffn norm), neox
  rotary on half of each head (a non-default partial_rotary_factor), no biases;
- stablelm_qkv_bias (StableLM-2-1.6B, StableLM-3B-4E1T without the biases): q/k/v biases, the sequential residual,
  the default quarter-head rotary;
- glm4 (GLM-4-9B-0414): four RMS norms a layer, interleaved rotary on half of each head, fused gate_up_proj, q/k/v
  biases; glm (GLM-4-9B-chat-hf): the same without the post norms.
test_rope_layout_matters shows the tests can fail: neox instead of interleaved, full instead of partial rotary, or
glm4 without its post norms, each moves the logits far past the tolerance.

GGUF: transformers reads stablelm files itself (not glm4 or chatglm, nor stablelm's stacked q/k norms), so the
general oracle is the HF model the file was written from, its weights rounded as the file rounds them.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import replace
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from backend_greedy import backend_greedy, host
from gguf import GGMLQuantizationType as Q
from gguf_write import TypeCycle, add_decoder_sizes, add_tensor, finish
from tiny_hf import assert_close, hf_logits, random_causal_lm, random_prompt
from transformers import AutoModelForCausalLM, Glm4Config, GlmConfig, StableLmConfig

from core.batch import make_batch
from ir.loader import LoadedModel, load_model
from ir.reference import ReferenceRunner

torch.set_num_threads(1)

VOCAB, PROMPT_LEN, NEW = 288, 24, 16
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
GLM = dict(head_dim=16, rms_norm_eps=1e-5)  # GlmConfig's head_dim defaults to 128 whatever the hidden size

CASES = {
    "stablelm_qk_norm_parallel": (StableLmConfig, dict(qk_layernorm=True, use_parallel_residual=True,
                                                       partial_rotary_factor=0.5)),
    "stablelm_qkv_bias": (StableLmConfig, dict(use_qkv_bias=True)),
    "glm4": (Glm4Config, GLM),
    "glm": (GlmConfig, GLM),
}
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
MLX = pytest.param("mlx", marks=needs_mlx)
BACKENDS = [MLX, pytest.param("cuda-cpu", marks=needs_triton), pytest.param("cuda", marks=[needs_triton, needs_cuda])]


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return random_prompt(seed, n, VOCAB)


@cache
def hf_model(case: str) -> torch.nn.Module:
    cls, extra = CASES[case]
    return random_causal_lm(cls(**{**TINY, **extra}))


@cache
def hf_greedy(case: str, ids: tuple[int, ...], n: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf_model(case).generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """case -> our LoadedModel of the case's save_pretrained folder; saved and loaded once per module."""
    models: dict[str, LoadedModel] = {}

    def get(case: str) -> LoadedModel:
        if case not in models:
            folder = tmp_path_factory.mktemp(case)
            hf_model(case).save_pretrained(folder)
            models[case] = load_model(folder, progress=False)
        return models[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_transformers(case, loaded):
    runner = ReferenceRunner(loaded(case), max_tokens=64)
    ids = prompt(1)
    ref = hf_logits(hf_model(case), ids)
    assert_close(runner.prompt_logits(ids), ref)
    outs, first = runner.greedy([ids], NEW)
    assert_close(first[0], ref[-1])
    assert outs[0] == hf_greedy(case, tuple(ids))


def make_backend(kind: str, model: LoadedModel):
    if kind == "mlx":
        from backends.mlx.backend import MLXBackend

        return MLXBackend(model, progress=False)
    from backends.cuda.backend import CUDABackend

    return CUDABackend(model, device="cpu" if kind == "cuda-cpu" else "cuda", dtype="f32", progress=False)


def prefill_then_greedy(backend, prompts: list[list[int]], steps: int, block_size: int = 4):
    """Every prompt's logits from one batched prefill, then `steps` greedy tokens of each; reversed block tables,
    as the reference's."""
    blocks = -(-(max(map(len, prompts)) + steps) // block_size)
    backend.allocate_kv(len(prompts) * blocks, block_size)
    tables = [list(range((i + 1) * blocks - 1, i * blocks - 1, -1)) for i in range(len(prompts))]
    rows = host(backend.forward(make_batch(prompts, [0] * len(prompts), tables, block_size, all_logits=True)))
    logits = np.split(rows, np.cumsum([len(p) for p in prompts])[:-1])
    tokens = [[int(x[-1].argmax())] for x in logits]
    cached = [len(p) for p in prompts]
    for _ in range(steps - 1):
        step = host(backend.forward(make_batch([t[-1:] for t in tokens], cached, tables, block_size)))
        for i, t in enumerate(step.argmax(-1)):
            cached[i] += 1
            tokens[i].append(int(t))
    return logits, tokens


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_transformers(case, kind, loaded):
    """Two prompts batched together: every prompt logit against transformers, then greedy tokens. Triton's
    interpreter runs one program a token, so the CUDA backend on CPU tensors gets shorter prompts and fewer steps,
    and skips glm (glm4 less two norms)."""
    if kind == "cuda-cpu" and case == "glm":
        pytest.skip("glm4 covers glm's ops on the CUDA backend under Triton's interpreter")
    prompts, steps = ([prompt(1), prompt(2, 9)], NEW) if kind != "cuda-cpu" else ([prompt(1, 10), prompt(2, 5)], 4)
    logits, tokens = prefill_then_greedy(make_backend(kind, loaded(case)), prompts, steps)
    for p, rows, toks in zip(prompts, logits, tokens, strict=True):
        assert_close(rows, hf_logits(hf_model(case), p))
        assert toks == hf_greedy(case, tuple(p))[:steps]


def _variant(model: LoadedModel, **cfg) -> LoadedModel:
    c = replace(model.config, **cfg)
    return replace(model, config=c, graph=model.arch.build(c, "f32"))


@pytest.mark.parametrize("case", ["stablelm_qk_norm_parallel", "glm4"])
def test_rope_layout_matters(case, loaded):
    """Each choice the tests check moves the logits by far more than the tolerance: the rotary pairs (neox vs
    interleaved), the rotary width (partial vs the whole head), and glm4's post norms."""
    model, ids = loaded(case), prompt(1)
    ref = hf_logits(hf_model(case), ids)
    rope = model.config.rope
    other = "neox" if rope.style == "interleaved" else "interleaved"
    variants = [_variant(model, rope=replace(rope, style=other)),
                _variant(model, rope=replace(rope, rotary_dim=model.config.head_dim))]
    if case == "glm4":
        from ir.models import by_name

        variants.append(replace(model, graph=by_name("glm").build(model.config, "f32")))  # no post norms
    for v in variants:
        err = np.abs(ReferenceRunner(v, max_tokens=64).prompt_logits(ids) - ref).max()
        assert err > 0.05 * np.abs(ref).max()


def test_config_flags_reach_the_graph(loaded):
    """The flags each case sets are read and shape the graph (a flag silently unread whose weights happen to be
    ignored would otherwise pass unnoticed)."""
    a, b, g4, g = (loaded(c) for c in CASES)
    assert a.config.qk_norm and a.config.parallel_residual and not a.config.qkv_bias
    assert a.config.rope.rotary_dim == 8 and a.config.rope.style == "neox"
    assert a.graph.params["layers.0.q_norm"].shape == (4, 16) and a.graph.params["layers.0.k_norm"].shape == (2, 16)
    assert "layers.0.ffn_norm" not in a.graph.params and "layers.0.bq" not in a.graph.params
    assert b.config.qkv_bias and not b.config.qk_norm and not b.config.parallel_residual
    assert b.config.rope.rotary_dim == 4 and "layers.0.ffn_norm_b" in b.graph.params
    assert a.sources["layers.1.q_norm"] == "model.layers.1.self_attn.q_layernorm.norms.*.weight"
    for m in (g4, g):
        assert m.config.rope.style == "interleaved" and m.config.rope.rotary_dim == 8
        assert m.config.qkv_bias and not m.config.o_bias and "layers.0.bo" not in m.graph.params
        assert m.sources["layers.0.w_up"] == m.sources["layers.0.w_gate"] == "model.layers.0.mlp.gate_up_proj.weight"
    assert "layers.1.attn_post_norm" in g4.graph.params and "layers.1.ffn_post_norm" in g4.graph.params
    assert not any("post" in p for p in g.graph.params)


def test_configs_that_leave_defaults_unsaid():
    """Hub configs written before transformers 5 may omit partial_rotary_factor or attention_bias: transformers'
    defaults apply (0.25 for stablelm, 0.5 and biases for GLM)."""
    from ir.models import by_name

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert by_name("stablelm").config_from_hf({**base, "model_type": "stablelm"}).rope.rotary_dim == 4
    glm = by_name("glm4").config_from_hf({**base, "model_type": "glm4", "head_dim": 16, "rope_theta": 5e5})
    assert (glm.rope.rotary_dim, glm.rope.theta, glm.qkv_bias, glm.o_bias) == (8, 5e5, True, False)


def test_fusion_pass_on_these_layouts(loaded):
    """Fusions are read off the graph: the parallel residual's five projections of one LayerNorm are one linear;
    glm4's post norms are plain norms, its residual adds still fuse with the next pre-norm; every layer's q/k rope goes
    into the attention (after the per-head LayerNorms, in stablelm's case)."""
    from ir.fusion import fuse

    def fused(graph):
        g = fuse(graph)
        matrices = sorted(p.name for p in g.params.values() if p.parts and len(p.shape) == 2)
        return g, matrices, Counter(n.op for n in g.nodes)

    _, names, ops = fused(loaded("stablelm_qk_norm_parallel").graph)
    assert names == [f"layers.{i}.wq+wk+wv+w_gate+w_up" for i in range(2)]
    assert ops["gated"] == 2 and ops["rope_attention"] == 2 and not ops["attention"] and not ops["add_rms_norm"]
    g4, names, ops = fused(loaded("glm4").graph)
    assert names == [f"layers.{i}.{w}" for i in range(2) for w in ("w_gate+w_up", "wq+wk+wv")]
    assert ops["rope_attention"] == 2 and ops["gated"] == 2
    # Norms after an add: layer 0's ffn_norm, layer 1's attn_norm and ffn_norm, the final norm.
    assert sorted(n.inputs[2].name for n in g4.nodes if n.op == "add_rms_norm") == [
        "final_norm", "layers.0.ffn_norm", "layers.1.attn_norm", "layers.1.ffn_norm"]


# --- GGUF ------------------------------------------------------------------------------------------------------

# case -> (the HF case it is written from, GGUF general.architecture)
GGUF_CASES = {
    "stablelm_qk_norm_parallel": ("stablelm_qk_norm_parallel", "stablelm"),
    "stablelm_qkv_bias": ("stablelm_qkv_bias", "stablelm"),
    "glm4": ("glm4", "glm4"),
    # llama.cpp's ChatGLMModel writes GlmForCausalLM as "chatglm"; ChatGLM's own checkpoints have q/k/v fused
    # (query_key_value -> attn_qkv), as this file has them.
    "chatglm_fused_qkv": ("glm", "chatglm"),
}
MIX = (Q.F16, Q.Q8_0, Q.F32)  # matrices cycle through these; fused ones are Q8_0, to split quantized blocks


def _tensors(case: str, model: torch.nn.Module) -> dict[str, tuple[np.ndarray, list[str]]]:
    """GGUF name -> (data, the HF tensors it holds), as llama.cpp's converter names (gguf-py's tensor map) and
    shapes them."""
    cfg, arch = model.config, GGUF_CASES[case][1]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     cfg.num_hidden_layers)
    state = {k: (v.float().numpy(), [k]) for k, v in model.state_dict().items()}

    def fuse(new: str, parts: list[str], stack: bool) -> None:
        held = [state.pop(k) for k in parts]
        data = (np.stack if stack else np.concatenate)([d for d, _ in held])
        state[new] = (data, [k for _, ks in held for k in ks])

    for i in range(cfg.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn"
        for norm in ("q_layernorm", "k_layernorm"):  # StableLMModel._stack_qk_norm
            heads = [k for k in state if k.startswith(f"{attn}.{norm}.norms.")]
            if heads:
                fuse(f"{attn}.{norm}.weight", heads, stack=True)
        if case == "chatglm_fused_qkv":
            for kind in ("weight", "bias"):
                fuse(f"blk.{i}.attn_qkv.{kind}", [f"{attn}.{x}_proj.{kind}" for x in "qkv"], stack=False)
    return {k if k.startswith("blk.") else names.get_name(k, try_suffixes=(".weight", ".bias")): v
            for k, v in state.items()}


def write_gguf(case: str, model: torch.nn.Module, path: Path) -> dict[str, Q]:
    cfg, arch = model.config, GGUF_CASES[case][1]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_sizes(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if arch == "stablelm":  # StableLMModel.set_gguf_parameters: no rope base (llama.cpp's default 10000 applies)
        w.add_parallel_residual(cfg.use_parallel_residual)
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        if arch == "glm4":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
    kinds, cycle = {}, TypeCycle(MIX)
    for name, (data, _) in _tensors(case, model).items():
        matrix = data.ndim == 2 and "norm" not in name  # llama.cpp's quantize leaves norms as they are
        qtype = cycle(data) if matrix else Q.F32
        if matrix and name.endswith(("ffn_up.weight", "attn_qkv.weight")) and arch != "stablelm":
            qtype = Q.Q8_0
        kinds[name] = add_tensor(w, name, data, qtype)
    finish(w)
    return kinds


def rounded_hf(case: str, kinds: dict[str, Q]) -> torch.nn.Module:
    """The source model with each weight rounded through its tensor's type in the file (Q8_0 blocks run along rows,
    so the rows of a fused tensor round as the separate tensors do)."""
    src = hf_model(GGUF_CASES[case][0])
    kind_of = {hf: kinds[name] for name, (_, held) in _tensors(case, src).items() for hf in held}
    state = {}
    for hf, t in src.state_dict().items():
        x = t.numpy()
        if kind_of[hf] == Q.F16:
            x = x.astype(np.float16).astype(np.float32)
        elif kind_of[hf] == Q.Q8_0:
            x = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)
        state[hf] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    out = random_causal_lm(src.config)
    out.load_state_dict(state)
    return out


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """case -> (path, tensor kinds); written once per module."""
    files: dict[str, tuple] = {}

    def get(case: str):
        if case not in files:
            path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
            files[case] = (path, write_gguf(case, hf_model(GGUF_CASES[case][0]), path))
        return files[case]

    return get


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_matches_rounded_hf(case, gguf_files):
    path, kinds = gguf_files(case)
    model = load_model(path, progress=False)
    assert model.arch.name == GGUF_CASES[case][0].split("_")[0]
    ids = prompt(2)
    assert_close(ReferenceRunner(model, max_tokens=64).prompt_logits(ids), hf_logits(rounded_hf(case, kinds), ids))
    assert Q.Q8_0 in kinds.values()


def test_gguf_stablelm_matches_transformers(gguf_files):
    """transformers reads a stablelm GGUF itself (biases and the residual kind from the tensors present)."""
    path, _ = gguf_files("stablelm_qkv_bias")
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    runner = ReferenceRunner(load_model(path, progress=False), max_tokens=64)
    ids = prompt(3)
    assert_close(runner.prompt_logits(ids), hf_logits(ref, ids))
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert runner.greedy([ids], NEW)[0][0] == out[0, len(ids):].tolist()


def test_gguf_config(gguf_files):
    cfgs = {c: load_model(gguf_files(c)[0], progress=False).config for c in GGUF_CASES}
    a, b = cfgs["stablelm_qk_norm_parallel"], cfgs["stablelm_qkv_bias"]
    assert a.parallel_residual and a.qk_norm and not a.qkv_bias and a.rope.rotary_dim == 8
    assert not b.parallel_residual and b.qkv_bias and not b.qk_norm and b.rope.rotary_dim == 4
    for c in (cfgs["glm4"], cfgs["chatglm_fused_qkv"]):
        assert c.qkv_bias and not c.o_bias and (c.rope.style, c.rope.rotary_dim) == ("interleaved", 8)


@pytest.mark.parametrize("kind", [MLX, pytest.param("cuda", marks=[needs_triton, needs_cuda])])
def test_gguf_glm4_on_backends(kind, gguf_files):
    """Q8_0 halves of the fused gate_up, fused again by the fusion pass (blocks or MLX groups concatenated). Not
    on CPU tensors: Triton's interpreter takes minutes over the quantized kernels (test_cuda_backend's Q8_0 tests
    cover those there)."""
    model = load_model(gguf_files("glm4")[0], progress=False)
    if kind == "mlx":
        from backends.mlx.backend import MLXBackend

        backend = MLXBackend(model, quantized=True, progress=False)
    else:
        from backends.cuda.weights import QuantWeight

        backend = make_backend(kind, model)
        assert isinstance(backend.params["layers.0.w_gate+w_up"], QuantWeight)
    prompts = [prompt(4, 7), prompt(5, 4)]
    ref = ReferenceRunner(model, max_tokens=64, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 3)
    tokens, first = backend_greedy(backend, ref, prompts, 3, 4)
    assert_close(first, ref_first)
    assert tokens == ref_tokens
