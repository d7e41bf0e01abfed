"""The CUDA backend's int8 KV cache (--kv-cache-dtype int8, kernels_src.kv_int8) against its 16-bit (here fp32)
cache, on CPU tensors under Triton's interpreter: tiny random models (GQA with neox rope, two KV groups with a
sliding window) keep their greedy tokens with logits within a stated tolerance, SmolLM2 keeps its 16 greedy tokens
(on a GPU; on CPU when asked), the bytes a block as allocated, and the refusals (head dims, MLA's latent) with the
CLI flag. The fp8 cache's: tests/test_cuda_kv_fp8.py."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from backend_greedy import backend_greedy
from kv_int8_models import tiny_model
from test_tiny_models import prompt

from frontend import cli
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")

# Of max |logit|: random tiny models attend sharply, so 8-bit keys move their logits by a few hundredths of the
# largest; a wrong group, scale or slot moves them by whole units.
TINY_RTOL = 0.05
# SmolLM2's first-step logits (the largest ~25): the int8 cache moved them by 0.57 on CPU tensors in fp32 (the MLX
# cache's affine groups by 0.27: its 255 steps span a group's range, these 254 twice its largest magnitude); a wrong
# scale or group moves them by whole units.
SMOLLM_TOL = 1.0
# SmolLM2 under Triton's interpreter takes ~2 min (two runs of 16 steps through 30 layers of interpreted kernels):
# past this file's share of the suite, so on CPU tensors only when asked (KV_INT8_SMOLLM_CPU=1); on a GPU always.
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
SMOLLM_DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not os.environ.get("KV_INT8_SMOLLM_CPU"),
                                                               reason="~2 min on CPU: KV_INT8_SMOLLM_CPU=1")),
                  pytest.param("cuda", marks=GPU)]
BS = 4


def _backend(model, device: str = "cpu", **kw):
    from backends.cuda.backend import CUDABackend

    return CUDABackend(model, device=device, **{"dtype": "f32", "progress": False, **kw})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["llama", "qwen2_swa"])
def test_tiny_models_keep_their_tokens(case, device, tmp_path):
    model = tiny_model(case, tmp_path)
    prompts = [prompt(1), prompt(2, 9), prompt(3, 17)]
    ref = ReferenceRunner(model, max_tokens=64, block_size=BS)
    want, want_first = backend_greedy(_backend(model, device), ref, prompts, 5, BS)
    int8 = _backend(model, device, kv_cache_dtype="int8")
    tokens, first = backend_greedy(int8, ref, prompts, 5, BS)
    assert all(t.dtype == torch.int8 for layer in int8.kv for t in layer[:2])
    err = float(np.abs(first - want_first).max()) / float(np.abs(want_first).max())
    assert 0 < err < TINY_RTOL, err
    assert tokens == want


def test_bytes_a_block(tmp_path):
    """A token's K and V take 1.125 bytes an element (a code, and an fp32 scale a group of 32) of fp32's 4, and the
    allocation is what kv_bytes_per_block says (the engine sizes its pools by it)."""
    model = tiny_model("llama", tmp_path)
    f32, int8 = _backend(model), _backend(model, kv_cache_dtype="int8")
    per_token = 2 * 2 * 2 * 32  # layers, K and V, 2 heads of 32
    assert int8.kv_bytes_per_block(BS) == BS * per_token * 9 // 8
    assert f32.kv_bytes_per_block(BS) / int8.kv_bytes_per_block(BS) == pytest.approx(4 / 1.125)
    int8.allocate_kv(5, BS)
    assert int8.memory().kv_bytes == 5 * int8.kv_bytes_per_block(BS)


@pytest.mark.parametrize("device", SMOLLM_DEVICES)
def test_smollm_keeps_its_greedy_tokens(smollm, device):
    """SmolLM2 with the int8 cache: the same 16 greedy tokens as its 16-bit cache (dense fp32 on CPU tensors; its
    GGUF weights in bf16 on a GPU, CUDA graphs on)."""
    err = smollm_keeps_its_tokens(smollm, device, "int8")
    assert 0 < err < SMOLLM_TOL, err


def smollm_keeps_its_tokens(smollm, device: str, kv_cache_dtype: str) -> float:
    """Asserts SmolLM2's 16 greedy tokens under `kv_cache_dtype` are its 16-bit cache's (and say Paris); returns the
    largest change of its first-step logits."""
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ref = ReferenceRunner(smollm, max_tokens=256, block_size=16)
    kw = dict(quantized=False) if device == "cpu" else dict(dtype="bf16")
    want, want_first = backend_greedy(_backend(smollm, device, **kw), ref, [ids], 16, 16)
    tokens, first = backend_greedy(_backend(smollm, device, kv_cache_dtype=kv_cache_dtype, **kw), ref, [ids], 16, 16)
    assert tokens == want and "Paris" in smollm.tokenizer.decode(tokens[0])
    return float(np.abs(first - want_first).max())


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="head dim of 16 is not a multiple of 32"):
        _backend(tiny_model("llama16", tmp_path / "a"), kv_cache_dtype="int8")
    with pytest.raises(NotImplementedError, match="int8 on the CUDA backend has no latent \\(MLA\\) cache"):
        _backend(tiny_model("deepseek_v2", tmp_path / "b"), kv_cache_dtype="int8")


def test_cli_flag():
    pytest.importorskip("pydantic")  # the CLI's (the GPU machine has none)
    assert cli.backend_options(cli.parse_args(["--backend", "cuda", "--kv-cache-dtype", "int8"]))[
        "kv_cache_dtype"] == "int8"
