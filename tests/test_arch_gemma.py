"""gemma, gemma2 and gemma3 (text) against transformers (eager attention, fp32): tiny random models saved with
`save_pretrained`, through the reference interpreter, the MLX backend and the CUDA backend on CPU tensors; and the
same kind of models as GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them.

Each case makes its features bite, and test_each_feature_matters checks that transformers' logits move without
each: 24-token prompts over a 6-token window, an attention softcap of 5 and a final one of 3 (gemma2),
query_pre_attn_scalar 24 != head_dim 16, gemma3's sliding layers on a rope of their own (theta 1e4) while its
global layer's is linearly scaled (theta 1e6, factor 4). Tolerance: 1e-4 relative (tiny_hf.assert_close).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_write import MIX, TypeCycle, add_decoder_sizes, add_tensor, finish
from tiny_hf import assert_close, hf_greedy, hf_logits, random_causal_lm, random_prompt, saved_models
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig

from ir.loader import load_model
from ir.reference import ReferenceRunner

torch.set_num_threads(1)

VOCAB, PROMPT_LEN, NEW, WINDOW = 320, 24, 16, 6
S, F = "sliding_attention", "full_attention"
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
GEMMA3_ROPE = {S: {"rope_type": "default", "rope_theta": 1e4},
               F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
CASES = {
    "gemma": (GemmaConfig, dict(num_hidden_layers=2)),
    "gemma2": (Gemma2Config, dict(num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (Gemma3TextConfig, dict(num_hidden_layers=3, layer_types=[S, S, F], sliding_window=WINDOW,
                                      query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE)),
}
HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_hf(case: str, seed: int = 0, **changes) -> torch.nn.Module:
    """tiny_hf's random model; gemma stores the w of (1 + w), so its norms' 1 + 0.2 N(0, 1) become 0.2 N(0, 1)."""
    cls, extra = CASES[case]
    model = random_causal_lm(cls(**{**TINY, **extra, **changes}), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    return model


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return random_prompt(seed, n, VOCAB)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (fp32 HF model, its save_pretrained folder, our loaded model); built once per module."""
    return saved_models(tmp_path_factory, make_hf, load=True)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_and_greedy_match_transformers(case, saved):
    model, _, loaded = saved(case)
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = prompt(1)
    ref = hf_logits(model, ids)
    assert_close(runner.prompt_logits(ids), ref)
    outs, first = runner.greedy([ids], NEW)
    assert_close(first[0], ref[-1])
    assert outs[0] == hf_greedy(model, ids, NEW)


CHANGES = [  # (case, what the variant changes, whether the first WINDOW positions stay the same)
    ("gemma2", dict(attn_logit_softcapping=None), False),
    ("gemma2", dict(final_logit_softcapping=None), False),
    ("gemma2", dict(query_pre_attn_scalar=16), False),
    ("gemma2", dict(sliding_window=PROMPT_LEN), True),
    ("gemma3", dict(sliding_window=PROMPT_LEN), True),
    ("gemma3", dict(rope_parameters={S: GEMMA3_ROPE[F], F: GEMMA3_ROPE[F]}), False),  # one rope for all layers
    ("gemma3", dict(rope_parameters={S: GEMMA3_ROPE[S], F: {**GEMMA3_ROPE[F], "rope_type": "default"}}), False),
]


@pytest.mark.parametrize(("case", "change", "same_inside_window"), CHANGES)
def test_each_feature_matters(case, change, same_inside_window, saved):
    """The same weights without a feature give other logits, so matching transformers really checks it (a window
    changes nothing until the prompt outgrows it)."""
    model = saved(case)[0]
    ids = prompt(1)
    ref, variant = hf_logits(model, ids), hf_logits(make_hf(case, **change), ids)
    if same_inside_window:
        np.testing.assert_allclose(variant[:WINDOW], ref[:WINDOW], rtol=0, atol=1e-5)
    assert np.abs(variant - ref).max() > 1e-2


def test_config_reaches_the_graph(saved):
    cfgs = {c: saved(c)[2].config for c in CASES}
    assert all(c.hidden_act == "gelu_tanh" and c.tie_word_embeddings for c in cfgs.values())
    assert cfgs["gemma"].sliding_window is None and not cfgs["gemma"].sandwich_norms
    g2, g3 = cfgs["gemma2"], cfgs["gemma3"]
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (5.0, 3.0, 24**-0.5)
    assert g2.layer_types == (S, F) and g3.layer_types == (S, S, F) and g3.qk_norm
    assert g3.rope.theta == 1e6 and g3.rope.rope_type == "linear" and g3.local_rope.theta == 1e4
    graph = saved("gemma3")[2].graph
    attn = [n.attrs for n in graph.nodes if n.op == "attention"]
    assert [a["sliding_window"] for a in attn] == [WINDOW, WINDOW, None]
    ropes = [n.attrs["spec"].theta for n in graph.nodes if n.op == "rope"]
    assert ropes == [1e4, 1e4, 1e4, 1e4, 1e6, 1e6]
    assert {n.attrs["offset"] for n in graph.nodes if n.op == "rms_norm"} == {1.0}
    assert graph.nodes[1].op == "scale" and graph.nodes[1].attrs["factor"] == 8.0  # sqrt(hidden)
    assert saved("gemma2")[2].graph.nodes[-1].op == "softcap"


@pytest.mark.parametrize("case", list(CASES))
def test_mlx_backend_matches_reference(case, saved):
    pytest.importorskip("mlx", reason="mlx is not installed (the GPU machine has none)")
    from backend_greedy import backend_greedy

    from backends.mlx.backend import MLXBackend

    loaded = saved(case)[2]
    prompts = [prompt(1), prompt(2, 9), prompt(3, 17)]
    ref = ReferenceRunner(loaded, max_tokens=256, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 12)
    tokens, first = backend_greedy(MLXBackend(loaded, progress=False), ref, prompts, 12, 4)
    assert_close(first, ref_first)
    assert tokens == ref_tokens


def test_mlx_kernel_wiring_through_the_simt_oracle(saved):
    """The Metal path's (1 + w) norm kernel and softcapped, windowed paged decode, run through the DSL's CPU
    execution of the same SIMT programs."""
    pytest.importorskip("mlx", reason="mlx is not installed (the GPU machine has none)")
    from backend_greedy import backend_greedy

    from backends.mlx.backend import MLXBackend

    loaded = saved("gemma2")[2]
    backend = MLXBackend(loaded, kernels="simt-cpu", progress=False)
    prompts = [prompt(1, 2 * WINDOW), prompt(2, 5)]
    ref = ReferenceRunner(loaded, max_tokens=64, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 4)
    tokens, first = backend_greedy(backend, ref, prompts, 4, 4)
    assert_close(first, ref_first)
    assert tokens == ref_tokens
    assert set(backend.kernels.launches) == {"rms_norm", "gated", "paged_decode"}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_backend_on_cpu_matches_reference(case, saved):
    """The fused paths (add + (1 + w) norm, gated gelu_tanh, rope + KV write, softcapped windowed attention in the
    prefill and decode kernels) against the reference. Short prompts: the Triton interpreter runs each program in
    Python."""
    from backend_greedy import backend_greedy

    from backends.cuda.backend import CUDABackend

    loaded = saved(case)[2]
    n = loaded.config.num_layers
    prompts = [prompt(4, 2 * WINDOW - 1), prompt(5, 3)]
    ref = ReferenceRunner(loaded, max_tokens=64, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 3)
    backend = CUDABackend(loaded, device="cpu", progress=False, dtype="f32")
    ops = [node.op for node in backend.graph.nodes]
    assert (ops.count("add_rms_norm"), ops.count("gated"), ops.count("rope_attention")) == (2 * n, n, n)
    tokens, first = backend_greedy(backend, ref, prompts, 3, 4)
    assert_close(first, ref_first)
    assert tokens == ref_tokens


# --- GGUF -------------------------------------------------------------------------------------------------------
# llama.cpp's converter stores norms as 1 + w, does not permute q/k, drops gemma/gemma2's lm_head (tied). It stores
# no query_pre_attn_scalar (llama.cpp takes head_dim below 27B) and fixes the layer patterns (gemma2: 2, gemma3: 6)
# and gemma3's local rope (theta 1e4), so the files' models have those; gemma3's six layers give one global layer.
GGUF_CASES = {"gemma": {}, "gemma2": dict(query_pre_attn_scalar=16),
              "gemma3": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16)}
GGUF_ARCH = {"gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
# transformers' GGUF reader (gemma2, gemma3; not gemma) reads neither the softcaps nor gemma3's rope scaling, and
# assumes query_pre_attn_scalar 256: only those are supplied.
HF_GGUF_CONFIG = {"gemma2": dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16),
                  "gemma3": dict(query_pre_attn_scalar=16, rope_parameters=GEMMA3_ROPE)}


def spm_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style list as llama.cpp's converter writes it: gemma's four specials, the 256 byte tokens,
    then pieces, best first (tokens, scores, types)."""
    letters = "abcdefghij"
    pieces = ["▁", *letters, *(f"▁{a}" for a in letters), *(a + b for a in letters for b in letters)][: n - 260]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return tokens, [0.0] * 260 + [-float(i) for i in range(len(pieces))], [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)


def make_gguf_source(case: str) -> torch.nn.Module:
    return make_hf(case, **GGUF_CASES[case])


def write_gguf(case: str, model: torch.nn.Module, path: Path) -> dict[str, Q]:
    """`model` as a GGUF file with convert_hf_to_gguf.py's metadata and tensor names; returns each tensor's type."""
    cfg, arch = model.config, GGUF_ARCH[case]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_decoder_sizes(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if case == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if case == "gemma3":
        glob = cfg.rope_parameters[F]
        w.add_rope_freq_base(glob["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(glob["factor"])
        w.add_sliding_window(cfg.sliding_window)
    tokens, scores, types = spm_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(False)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    kinds, cycle = {}, TypeCycle(start=list(GGUF_CASES).index(case))
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, data = names.get_name(hf, try_suffixes=(".weight",)), t.float().numpy()
        if hf.endswith("norm.weight"):
            data = data + np.float32(1.0)
        kinds[hf] = add_tensor(w, name, data, cycle(data))
    finish(w)
    return kinds


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """case -> (GGUF path, the type of each HF tensor in it, the source HF model, our loaded model)."""
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            path, model = tmp_path_factory.mktemp(f"{case}_gguf") / f"{case}.gguf", make_gguf_source(case)
            kinds = write_gguf(case, model, path)
            cache[case] = (path, kinds, model, load_model(path, progress=False))
        return cache[case]

    return get


def rounded_hf(case: str, model: torch.nn.Module, kinds: dict[str, Q]) -> torch.nn.Module:
    """The source model with each matrix rounded through its file type (F16, or Q8_0 with gguf-py)."""
    out, state = make_gguf_source(case), {}
    for hf, t in model.state_dict().items():
        x, kind = t.numpy(), kinds.get(hf, kinds["model.embed_tokens.weight"])  # a tied head is the embedding
        if kind == Q.F16:
            x = x.astype(np.float16).astype(np.float32)
        elif kind == Q.Q8_0:
            x = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)
        state[hf] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    out.load_state_dict(state)
    return out


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_matches_rounded_hf(case, gguf_files):
    """Prompt logits and 16 greedy tokens against the source model with the file's rounding (an oracle that does
    not depend on transformers' GGUF reader, which has no gemma (1))."""
    path, kinds, model, loaded = gguf_files(case)
    assert set(kinds.values()) == set(MIX)
    ref = rounded_hf(case, model, kinds)
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = prompt(2)
    assert_close(runner.prompt_logits(ids), hf_logits(ref, ids))
    assert runner.greedy([ids], NEW)[0][0] == hf_greedy(ref, ids, NEW)


@pytest.mark.parametrize("case", list(HF_GGUF_CONFIG))
def test_gguf_matches_transformers(case, gguf_files):
    path, _, _, loaded = gguf_files(case)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                               attn_implementation="eager", **HF_GGUF_CONFIG[case]).eval()
    ids = prompt(3)
    assert_close(ReferenceRunner(loaded, max_tokens=64).prompt_logits(ids), hf_logits(ref, ids))


def test_gguf_config_and_types(gguf_files):
    """Hyper-parameters as llama.cpp reads them; quantized tensors stay quantized; the SentencePiece vocabulary
    gives a tokenizer (tests/test_tokenizer_gemma.py checks one against SentencePiece)."""
    cfgs = {c: gguf_files(c)[3].config for c in GGUF_CASES}
    assert all(c.tie_word_embeddings and c.head_dim == 16 and c.attn_scale == 0.25 for c in cfgs.values())
    assert cfgs["gemma"].sliding_window is None and cfgs["gemma"].final_softcap is None
    g2, g3 = cfgs["gemma2"], cfgs["gemma3"]
    assert (g2.sliding_window, g2.attn_softcap, g2.final_softcap, g2.layer_types) == (WINDOW, 5.0, 3.0, (S, F))
    assert g3.layer_types == (S,) * 5 + (F,) and g3.attn_softcap is None and g3.qk_norm
    assert (g3.rope.theta, g3.rope.rope_type, g3.local_rope.theta) == (1e6, "linear", 1e4)
    loaded = gguf_files("gemma2")[3]
    assert loaded.weights["embed"].kind == MIX[1].name and loaded.weights["layers.0.post_attn_norm"].kind == "F32"
    tok = loaded.tokenizer
    tokens = spm_vocab(VOCAB)[0]
    assert tok is not None and tok.bos_id == 2
    assert tok.encode(" ab") == [2, tokens.index("▁a"), tokens.index("b")]  # ▁a scores above ab
    assert tok.decode(tok.encode(" ab ja"), skip_special_tokens=True) == " ab ja"


def test_gguf_rules_llama_cpp_fixes():
    """What llama.cpp decides without metadata: the 27B models' scale (hidden / heads), gemma2's defaults, and a
    gemma3 file without a window: global layers only, all on the global rope."""
    from ir.models import by_name

    def meta(arch: str, layers: int, **extra) -> dict:
        keys = dict(block_count=layers, embedding_length=4608, feed_forward_length=64, **{
            "attention.head_count": 32, "attention.head_count_kv": 16, "attention.key_length": 128}, **extra)
        return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()},
                f"{arch}.vocab_size": VOCAB}

    g2 = by_name("gemma2").config_from_gguf(meta("gemma2", 46), [])
    assert (g2.attn_scale, g2.sliding_window, g2.attn_softcap, g2.final_softcap) == (144**-0.5, 4096, 50.0, 30.0)
    assert by_name("gemma2").config_from_gguf(meta("gemma2", 42), []).attn_scale == 128**-0.5
    g3 = by_name("gemma3").config_from_gguf(meta("gemma3", 62), [])
    assert g3.attn_scale == 144**-0.5 and g3.window_for(0) is None and g3.rope_for(0) == g3.rope
    g3 = by_name("gemma3").config_from_gguf(meta("gemma3", 26, **{"attention.sliding_window": 512}), [])
    assert g3.window_for(0) == 512 and g3.window_for(5) is None and g3.rope_for(0).theta == 1e4
