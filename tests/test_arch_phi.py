"""phi-2 and phi-3 against transformers (eager attention, fp32), through the reference interpreter, the MLX backend
and the CUDA backend (CPU tensors), from safetensors and from GGUF files written the way llama.cpp's converter
writes them.

Each case exercises what a default would hide: phi-2's parallel attention + MLP block on one LayerNorm, partial
rotary, biases everywhere (the lm_head too), gelu_new, and its optional q/k LayerNorms; phi-3's fused qkv_proj and
gate_up_proj, longrope with original_max_position_embeddings = 16 so that 24-token prompts take the long factors
while shorter ones start on the short factors and cross over while decoding (and, with partial rotary, factor
tables of rotary_dim / 2 entries), and a sliding window shorter than the prompt with tied embeddings.

transformers 5.24 cannot serve as the GGUF oracle here: its phi3 GGUF reader keeps neither the longrope factors,
the rope dimension count nor the sliding window, and it reads no phi2 GGUF. The oracle for the GGUF files is the HF
model they were written from, its weights rounded as the file rounds them.

Tolerance: max|ours - ref| <= 1e-4 * max|ref| over all logits ("1e-4 relative").
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from backend_greedy import backend_greedy
from tiny_hf import assert_close, hf_logits, random_causal_lm, random_prompt, saved_models
from transformers import Phi3Config, PhiConfig

from core.batch import make_batch
from ir.reference import ReferenceRunner
from ir.rope import inv_freq

torch.set_num_threads(1)

VOCAB, PROMPT_LEN, NEW = 320, 24, 16
ORIGINAL = 16  # longrope's original_max_position_embeddings: a 24-token prompt takes the long factors
_rng = np.random.default_rng(7)
SHORT = (1.0 + 0.5 * _rng.random(6)).round(3).tolist()  # rotary_dim 12 (partial 0.75 of 16): 6 factors
LONG = (2.0 + 6.0 * _rng.random(6)).round(3).tolist()
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG,
            "partial_rotary_factor": 0.75}
CASES = {
    # phi-2's shape: MHA, partial rotary 0.4 of head_dim 16 (6 dims), intermediate = 4 * hidden (the GGUF converter
    # writes 4 * n_embd as feed_forward_length).
    "phi2": (PhiConfig, dict(intermediate_size=256, partial_rotary_factor=0.4, hidden_act="gelu_new")),
    "phi_qk_ln": (PhiConfig, dict(intermediate_size=256, qk_layernorm=True, tie_word_embeddings=True)),
    "phi3_longrope": (Phi3Config, dict(intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False,
                                       original_max_position_embeddings=ORIGINAL, rope_parameters=LONGROPE)),
    "phi3_swa": (Phi3Config, dict(intermediate_size=128, num_key_value_heads=2, sliding_window=8,
                                  tie_word_embeddings=True)),
}
HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_hf(case: str, seed: int = 0, **override) -> torch.nn.Module:
    cls, extra = CASES[case]
    return random_causal_lm(cls(**{**BASE, **extra, **override}), seed)


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return random_prompt(seed, n, VOCAB)


def hf_generate(model: torch.nn.Module, ids: list[int], n: int, logits: bool = False):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=logits)
    new = out.sequences[0, len(ids):].tolist()
    assert len(new) == n, "transformers stopped early"
    return (new, np.stack([s[0].float().numpy() for s in out.logits])) if logits else new


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (fp32 HF model, folder with its safetensors save, our loaded model); built once per module."""
    return saved_models(tmp_path_factory, make_hf, load=True)


# --- the HF path, through the reference interpreter ---------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_and_greedy_match_transformers(case, saved):
    model, _, loaded = saved(case)
    runner = ReferenceRunner(loaded, max_tokens=64)
    ids = prompt(1)
    ref = hf_logits(model, ids)
    assert_close(runner.prompt_logits(ids), ref)
    outs, first = runner.greedy([ids], NEW)
    assert_close(first[0], ref[-1])
    assert outs[0] == hf_generate(model, ids, NEW)


def test_config_flags_reach_the_graph(saved):
    """Guards against the end-to-end tests passing for the wrong reason (a flag silently unread)."""
    cfgs = {c: saved(c)[2].config for c in CASES}
    assert cfgs["phi2"].rope.rotary_dim == 6 and cfgs["phi_qk_ln"].rope.rotary_dim == 8  # 0.4 and PhiConfig's 0.5
    assert cfgs["phi2"].hidden_act == "gelu_tanh" and not cfgs["phi2"].qk_norm and cfgs["phi_qk_ln"].qk_norm
    assert cfgs["phi_qk_ln"].tie_word_embeddings and not cfgs["phi2"].tie_word_embeddings
    rope = cfgs["phi3_longrope"].rope
    assert rope.rope_type == "longrope" and rope.rotary_dim == 12
    p = dict(rope.scaling)
    assert p["original_max_position_embeddings"] == ORIGINAL
    assert p["attention_factor"] == pytest.approx((1 + np.log(128 / ORIGINAL) / np.log(ORIGINAL)) ** 0.5)
    assert cfgs["phi3_swa"].sliding_window == 8 and cfgs["phi3_swa"].layer_types is None
    assert cfgs["phi3_swa"].tie_word_embeddings and cfgs["phi3_swa"].rope.rope_type == "default"
    graph = saved("phi2")[2].graph
    assert {"lm_head_b", "layers.0.bo", "layers.0.b_up", "final_norm_b"} <= set(graph.params)
    assert [n.op for n in graph.nodes].count("layer_norm") == 3  # one a layer, one final: the block is parallel


def test_longrope_picks_its_factors_by_length(saved):
    """The factors matter, and which set is used follows the sequence's length: with the long factors replaced by
    the short ones, a 12-token prompt (under 16) gives the same logits and a 24-token prompt different ones; with
    plain rope instead of longrope both differ."""
    model, _, _ = saved("phi3_longrope")
    state = model.state_dict()
    short_only = make_hf("phi3_longrope", rope_parameters={**LONGROPE, "long_factor": SHORT})
    plain = make_hf("phi3_longrope", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.75})
    for other in (short_only, plain):
        other.load_state_dict(state)
    short_ids, long_ids = prompt(4, 12), prompt(4)
    np.testing.assert_allclose(hf_logits(short_only, short_ids), hf_logits(model, short_ids), rtol=0, atol=1e-5)
    assert np.abs(hf_logits(short_only, long_ids) - hf_logits(model, long_ids)).max() > 1e-2
    assert np.abs(hf_logits(plain, short_ids) - hf_logits(model, short_ids)).max() > 1e-2


@pytest.mark.skipif(tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) < (5, 24),
                    reason="the behaviour pinned is transformers 5.24's (CI's); 5.17 (the H200's) steps phi3's "
                           "longrope cache differently (logits 5.18 apart there)")
def test_longrope_switch_while_decoding_matches_transformers(saved):
    """A 12-token prompt starts on the short factors; transformers' rotary embedding takes the long ones in the
    forward whose sequence passes 16 tokens, for that forward's tokens (cached keys keep their rotation). Every
    step's logits are checked against transformers stepping with its KV cache, so a rule that switched late, early
    or per batch would fail. transformers' generate() goes further for phi3 (prepare_inputs_for_generation drops the
    cache once, at the switch, and recomputes the sequence on the long factors); that is pinned here too, as the
    behaviour we knowingly differ from (see ir.rope.long_after)."""
    from transformers import DynamicCache

    model, _, loaded = saved("phi3_longrope")
    ids = prompt(5, 12)
    tokens, generated = hf_generate(model, ids, 8, logits=True)
    cache, stepped, chunk = DynamicCache(config=model.config), [], ids
    with torch.no_grad():
        for t in tokens:
            stepped.append(model(torch.tensor([chunk]), cache=cache, use_cache=True).logits[0, -1].numpy())
            chunk = [t]
    stepped = np.stack(stepped)
    runner = ReferenceRunner(loaded, max_tokens=64)
    kv, table = runner._cache(1), [runner._table(0)]
    chunk, cached, ours = list(ids), 0, []
    for t in tokens:
        batch = make_batch([chunk], [cached], table, runner.block_size)
        ours.append(runner.interp.run(batch.inputs(), kv)["logits"][0])
        cached, chunk = cached + len(chunk), [t]
    assert_close(np.stack(ours), stepped)
    switch = ORIGINAL - len(ids) + 1  # the step whose sequence has 17 tokens
    assert_close(generated[:switch], stepped[:switch])
    assert np.abs(generated[switch:] - stepped[switch:]).max() > 1e-2
    assert_close(generated[switch:], hf_logits(model, ids + tokens)[len(ids) - 1 + switch:-1])


@pytest.mark.parametrize("case", ["phi2", "phi3_longrope"])
def test_varlen_batch_matches_single(case, saved):
    """Prompts of 5, 19 and 11 tokens decoded together give the tokens each gives alone; for longrope the batch
    mixes sequences on the long factors (19) with ones on the short (5, 11: 11 crosses 16 while decoding)."""
    runner = ReferenceRunner(saved(case)[2], max_tokens=64)
    prompts = [prompt(10, 5), prompt(11, 19), prompt(12, 11)]
    together, _ = runner.greedy(prompts, 8)
    assert together == [runner.greedy([p], 8)[0][0] for p in prompts]


def test_phi3_window_is_active_in_transformers(saved):
    """The window case tests the window only if transformers applies it at this length."""
    model, _, _ = saved("phi3_swa")
    ids = prompt(1)
    windowed = hf_logits(model, ids)
    model.config.sliding_window = None
    try:
        full = hf_logits(model, ids)
    finally:
        model.config.sliding_window = 8
    np.testing.assert_allclose(windowed[:8], full[:8], rtol=0, atol=1e-5)
    assert np.abs(windowed[8:] - full[8:]).max() > 1e-2


def test_old_phi3_config_keys():
    """A Phi-3.5-mini style config.json: rope_scaling {"type": "longrope", factors}, original_max_position_embeddings,
    rope_theta and partial_rotary_factor at the top, no factor: our tables equal transformers' (short, long,
    attention factor). Phi-3-mini-128k's first files said "su": the same for us (transformers 5.24 fails on it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ir.models import for_hf

    hf = {**BASE, "model_type": "phi3", "intermediate_size": 128, "max_position_embeddings": 256,
          "original_max_position_embeddings": 32, "rope_theta": 500.0, "partial_rotary_factor": 0.75,
          "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}
    arch = for_hf("phi3")
    ours = arch.config_from_hf(hf).rope
    ref = Phi3Config.from_dict(dict(hf))
    for long in (False, True):
        inv, attn = ROPE_INIT_FUNCTIONS["longrope"](ref, None, seq_len=33 if long else None)
        mine, my_attn = inv_freq(ours, long=long)
        np.testing.assert_allclose(mine, inv.numpy(), rtol=1e-6)
        assert my_attn == pytest.approx(attn) and my_attn > 1.1
    assert arch.config_from_hf({**hf, "rope_scaling": {**hf["rope_scaling"], "type": "su"}}).rope == ours


# --- backends against the reference ---------------------------------------------------------------------------------

def _check(backend, loaded, prompts, steps, block_size=4):
    ref = ReferenceRunner(loaded, max_tokens=256, block_size=block_size)
    ref_tokens, ref_first = ref.greedy(prompts, steps)
    tokens, first = backend_greedy(backend, ref, prompts, steps, block_size)
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
    assert tokens == ref_tokens


@pytest.mark.parametrize("case", list(CASES))
def test_mlx_matches_reference(case, saved):
    """Prompts of 24, 9 and 17 tokens, 12 steps: for longrope, 24 and 17 take the long factors from the prefill, 9
    crosses over at its 17th token."""
    pytest.importorskip("mlx")
    from backends.mlx.backend import MLXBackend

    loaded = saved(case)[2]
    _check(MLXBackend(loaded, progress=False), loaded, [prompt(1), prompt(2, 9), prompt(3, 17)], 12)


def test_mlx_compiled_decode_longrope(saved):
    """The compiled decode step (Metal's default) builds its own rope tables: one sequence on each table."""
    pytest.importorskip("mlx")
    from backends.mlx.backend import MLXBackend

    loaded = saved("phi3_longrope")[2]
    backend = MLXBackend(loaded, compile=True, progress=False)
    calls, step = [], backend.decode._fn
    backend.decode._fn = lambda *a: calls.append(1) or step(*a)
    _check(backend, loaded, [prompt(1), prompt(2, 15)], 3)
    assert len(calls) == 2  # both decode steps; the second switches the 15-token prompt to the long table


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("case", ["phi2", "phi3_longrope"])  # windows: test_cuda_backend's mistral case
def test_cuda_matches_reference(case, device, saved):
    """Without a GPU: CPU tensors, the kernels under Triton's interpreter (on a GPU, tools/gpu_check.sh: decode steps
    from CUDA graphs). Prompts of 24 and 15 tokens, 3 steps: for longrope the 15-token one switches tables at its
    second decode step, inside the fused rope + KV-write kernel."""
    from backends.cuda.backend import CUDABackend

    loaded = saved(case)[2]
    backend = CUDABackend(loaded, device=device, dtype="f32", progress=False)
    _check(backend, loaded, [prompt(1), prompt(2, 15)], 3)


def test_fusion_on_the_parallel_block(saved):
    """phi-2's q, k, v and fc1 read the same LayerNorm: one linear with four parts and their biases; the partial
    rope still goes into the attention; no add + rms_norm (LayerNorms), no gated activation."""
    from collections import Counter

    from ir.fusion import fuse

    g = fuse(saved("phi2")[2].graph)
    fused = {n: len(p.parts) for n, p in g.params.items() if p.parts}
    assert fused == {f"layers.{i}.{w}": 4 for i in range(2) for w in ("wq+wk+wv+w_up", "bq+bk+bv+b_up")}
    ops = Counter(n.op for n in g.nodes)
    assert ops["rope_attention"] == 2 and not ops["add_rms_norm"] and not ops["gated"]
