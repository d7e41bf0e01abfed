"""The MLX backend's 8-bit KV cache (--kv-cache-dtype int8, backends.mlx.kv_quant) against its float cache: the
round trip of each group against numpy, SmolLM2's greedy tokens and logits, tiny random models (two KV groups, MLA's
latent) over several blocks with a second request reusing the first one's blocks, the bytes a token of the real
allocation, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from backend_greedy import backend_greedy, host
from kv_int8_models import tiny_model
from test_tiny_models import VOCAB
from tiny_hf import random_prompt

from backends.base import create_backend
from backends.mlx import kv_quant
from backends.mlx.backend import MLXBackend
from backends.mlx.runtime import mx
from core.batch import make_batch
from frontend import cli
from frontend.engine.engine import EngineConfig, LLMEngine
from ir.kv_groups import kv_layout
from ir.reference import ReferenceRunner

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's first-step logits with the int8 cache differ from the f32 cache's by 0.27 at most (the largest logit is
# 25): 8-bit steps of keys with outlier channels. A wrong group, scale or slot moves them by whole units.
SMOLLM_TOL = 0.5
# Of max |logit|: random tiny models attend sharply, so 8-bit keys move their logits by up to 0.05 of the largest
# (numpy's round trip in a float cache moves them as much: the tight check is against that).
TINY_RTOL = 0.1
BS = 4


def np_affine(x: np.ndarray) -> np.ndarray:
    """x quantized to 8-bit affine groups of 32 and back, in numpy: MLX's rule (the scale's edge, the group's min or
    max whichever is larger in magnitude, lands exactly on a code, so a zero point is exact)."""
    g = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    hi, lo = g.max(-1, keepdims=True), g.min(-1, keepdims=True)
    low_edge = np.abs(lo) > np.abs(hi)
    scale = np.maximum((hi - lo) / 255, 1e-7)
    scale = np.where(low_edge, scale, -scale)
    edge = np.where(low_edge, lo, hi)
    q0 = np.round(edge / scale)
    scale = np.where(q0 != 0, edge / np.where(q0 == 0, 1, q0), scale)
    bias = np.where(q0 == 0, 0, edge)
    return (np.clip(np.round((g - bias) / scale), 0, 255) * scale + bias).reshape(x.shape)


def test_round_trip_matches_numpy():
    """Rows written at scattered slots read back as numpy's round trip of each 32-wide group (groups whose ranges
    differ 1000-fold, so a wrong group or zero point is far off), within one 8-bit step of the input."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 2, 64)).astype(np.float32) * 10.0 ** rng.integers(-2, 2, (7, 2, 2)).repeat(32, -1)
    cache = kv_quant.allocate(9, 2, 64, mx.float32)
    kv_quant.write(cache, mx.array([8, 0, 3, 5, 1, 2, 7]), mx.array(x))
    assert cache.codes.dtype == mx.uint32 and cache.codes.shape == (9, 2, 16) and cache.scales.shape == (9, 2, 2)
    back = np.array(kv_quant.read(cache, mx.array([[0, 1], [3, 2]])))  # the slots of rows 1, 4, 2, 5
    want = np_affine(x)[[1, 4, 2, 5]].reshape(back.shape)
    np.testing.assert_allclose(back, want, rtol=1e-6, atol=1e-9)
    groups = x[[1, 4, 2, 5]].reshape(4, 2, 2, 32)
    step = (groups.max(-1) - groups.min(-1)) / 255
    assert np.all(np.abs(back.reshape(4, 2, 2, 32) - groups).max(-1) <= step * 1.0001)


def test_smollm_keeps_its_greedy_tokens(smollm, mlx_smollm):
    ids = smollm.tokenizer.apply_chat_template(QUESTION)
    ref = ReferenceRunner(smollm, max_tokens=256, block_size=16)
    want, want_first = backend_greedy(mlx_smollm, ref, [ids], 16, 16)
    backend = MLXBackend(smollm, progress=False, compile=True, kv_cache_dtype="int8")
    tokens, first = backend_greedy(backend, ref, [ids], 16, 16)
    assert tokens == want and "Paris" in smollm.tokenizer.decode(tokens[0])
    err = float(np.abs(first - want_first).max())
    assert 0 < err < SMOLLM_TOL, err
    # Bytes a token as allocated: per layer, K and V of 3 heads, 64 codes and 2 f32 (scale, bias) a group of 32.
    cfg, blocks = smollm.config, ref.blocks_per_seq
    assert backend.kv_bytes_per_block(16) == cfg.num_layers * 16 * 2 * 3 * (64 + 2 * 4 * 2)
    assert backend.memory().kv_bytes == (blocks + 1) * backend.kv_bytes_per_block(16)  # + the scratch block
    assert mlx_smollm.kv_bytes_per_block(16) / backend.kv_bytes_per_block(16) == pytest.approx(3.2)


def _steps(backend: MLXBackend, groups: int) -> list[np.ndarray]:
    """Prompt A (6 blocks), then B sharing A's first 3 blocks (12 tokens cached) and adding 10, then one decode of
    each: every row's logits of each step."""
    a = random_prompt(1, 22, VOCAB)
    b = a[:12] + random_prompt(2, 10, VOCAB)
    ta, tb = [5, 0, 3, 1, 4, 2], [5, 0, 3, 9, 7, 8]
    backend.allocate_kv([16] * groups, BS)

    def step(chunks, cached, tables):
        return host(backend.forward(make_batch(chunks, cached, tables, BS, True, [tables] * (groups - 1))))

    return [step([a], [0], [ta]), step([b[12:]], [12], [tb]), step([[7], [11]], [22, 22], [ta, tb])]


@pytest.mark.parametrize("case", ["llama", "qwen2_swa", "deepseek_v2"])
def test_tiny_models_over_reused_blocks(case, tmp_path, monkeypatch):
    """Every step's logits as the float cache's when its writes are numpy's 8-bit round trip (np_affine), and within
    TINY_RTOL of the plain float cache's; B's rows over A's reused 8-bit blocks as when B is prefilled on its own."""
    model = tiny_model(case, tmp_path)
    groups = kv_layout(model.graph).num_groups
    int8 = MLXBackend(model, progress=False, compile=False, kv_cache_dtype="int8")
    got = _steps(int8, groups)
    # Codes, scales and biases of each cache: K and V, or MLA's one latent.
    assert [len(layer) for layer in int8.kv] == [3 if case == "deepseek_v2" else 6] * model.config.num_layers
    assert int8.kv[0][0].dtype == mx.uint32
    plain = _steps(MLXBackend(model, progress=False, compile=False), groups)
    write = kv_quant.write

    def np_write(cache, slots, x):  # the float cache given numpy's quantized values
        return write(cache, slots, mx.array(np_affine(np.array(x))))

    monkeypatch.setattr(kv_quant, "write", np_write)
    want = _steps(MLXBackend(model, progress=False, compile=False), groups)
    monkeypatch.undo()
    for w, p, g in zip(want, plain, got, strict=True):
        scale = float(np.abs(w).max())
        assert float(np.abs(g - w).max()) <= 1e-4 * scale
        assert 0 < float(np.abs(g - p).max()) <= TINY_RTOL * scale
    fresh = MLXBackend(model, progress=False, compile=False, kv_cache_dtype="int8")
    fresh.allocate_kv([16] * groups, BS)
    b = random_prompt(1, 22, VOCAB)[:12] + random_prompt(2, 10, VOCAB)
    table = [10, 11, 12, 13, 14, 15]
    whole = host(fresh.forward(make_batch([b], [0], [table], BS, True, [[table]] * (groups - 1))))
    assert float(np.abs(whole[12:] - got[1]).max()) <= 1e-4 * float(np.abs(whole).max())


def test_bytes_per_token_halve_at_f16(tmp_path):
    """At f16 a token's K and V take 1.125 bytes an element (a byte, and an f16 scale and bias a group of 32) of
    the f16 cache's 2: the engine's budget holds 1.78x the blocks."""
    model = tiny_model("llama", tmp_path)
    f16 = MLXBackend(model, dtype="f16", progress=False)
    int8 = MLXBackend(model, dtype="f16", progress=False, kv_cache_dtype="int8")
    int8.allocate_kv(5, BS)
    per_token = 2 * 2 * (32 + 2 * 2 * 1)  # layers, K and V; 2 heads of 32 codes, a scale and bias
    assert int8.kv_bytes_per_block(BS) == BS * 2 * per_token
    assert int8.memory().kv_bytes == 6 * int8.kv_bytes_per_block(BS)
    assert f16.kv_bytes_per_block(BS) / int8.kv_bytes_per_block(BS) == pytest.approx(2 / 1.125)
    # The engine sizes its pool by those bytes: the same budget holds 1.78x the blocks.
    budget = 1000 * f16.kv_bytes_per_block(BS)
    engines = [LLMEngine(b, EngineConfig(block_size=BS, kv_cache_bytes=budget, max_model_len=64)) for b in (f16, int8)]
    assert [e.blocks.num_blocks for e in engines] == [1000, 1000 * 2 * 32 // 36]
    assert int8.memory().kv_bytes <= budget + int8.kv_bytes_per_block(BS)  # + its scratch block


def test_refusals(tmp_path, capsys):
    with pytest.raises(ValueError, match="head .*dim of 16 is not a multiple of 32"):
        MLXBackend(tiny_model("llama16", tmp_path), progress=False, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="MLX has no FP8 type"):
        create_backend("mlx", None, kv_cache_dtype="fp8")
    for backend, dtype, why in [("mlx", "fp8", "no FP8 type"),  # CUDA's: test_cuda_kv_int8
                                ("mlx", "int4", "invalid choice")]:
        with pytest.raises(SystemExit):
            cli.parse_args(["--backend", backend, "--kv-cache-dtype", dtype])
        assert why in capsys.readouterr().err
    assert cli.backend_options(cli.parse_args(["--backend", "mlx", "--kv-cache-dtype", "int8"])) == {
        "kv_cache_dtype": "int8"}
