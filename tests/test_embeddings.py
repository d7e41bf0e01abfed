"""Embedding models: a tiny random Qwen3 saved as Qwen3-Embedding is (bare decoder, sentence-transformers' pooling
files), its vectors from our engine against transformers' Qwen3Model on MLX (CPU) and on the CUDA backend on CPU
tensors; mean pooling and CLS, chunked prefills, a pool that holds one input, and how the pooling files are read."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from tiny_embed import hf_embedding, save_tiny_embedding_qwen3

from frontend.engine.engine import EngineConfig
from frontend.engine.llm import LLM
from frontend.engine.scheduler import SchedulerConfig
from ir.formats.errors import ModelFormatError
from ir.loader import load_model
from ir.pooling import Pooling, read_pooling, task_of
from tools.tiny_hf import random_prompt

# A step computes at most 16 tokens: the 40-token input runs in three chunks beside the others.
CHUNKED = EngineConfig(num_kv_blocks=32, scheduler=SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=16))
# These run on MLX (CI installs it); the GPU machine's image has no mlx, and tools/gpu_check.sh runs this file there
needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="MLX is not installed")
PROMPTS = [random_prompt(1, 7, 512), random_prompt(2, 40, 512), random_prompt(3, 1, 512), random_prompt(4, 23, 512)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """mode -> (transformers' decoder, our loaded model), each saved once."""
    cache = {}

    def get(mode: str):
        if mode not in cache:
            folder = tmp_path_factory.mktemp(f"embed-{mode}")
            decoder = save_tiny_embedding_qwen3(folder, mode)
            cache[mode] = decoder, load_model(folder, progress=False)
        return cache[mode]

    return get


def _check(llm: LLM, decoder, mode: str) -> None:
    outs = llm.embed(PROMPTS)
    for p, out in zip(PROMPTS, outs, strict=True):
        ref = hf_embedding(decoder, p, mode)
        assert out.embedding.dtype == np.float32 and out.embedding.shape == ref.shape
        np.testing.assert_allclose(out.embedding, ref, atol=1e-4, rtol=0)
        assert abs(float(np.linalg.norm(out.embedding)) - 1) < 1e-5
    # different inputs give vectors far apart: a pooling that ignored its rows would not
    assert float(np.abs(outs[0].embedding - outs[1].embedding).max()) > 0.05
    assert llm.engine.all_blocks_free() and not llm.engine.pooler.pooled


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_mlx_embeddings_equal_transformers(models, mode):
    from backends.mlx.backend import MLXBackend

    decoder, model = models(mode)
    assert model.pooling == Pooling(mode, True, 64) and "lm_head" not in model.graph.params
    _check(LLM.from_backend(MLXBackend(model, progress=False), CHUNKED), decoder, mode)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_backend_embeddings_equal_transformers(models, device):
    """On CPU tensors here; on a GPU too where there is one (tools/gpu_check.sh's machine)."""
    import torch

    from backends.cuda.backend import CUDABackend

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    decoder, model = models("last")
    backend = CUDABackend(model, device=device, dtype="f32", progress=False)
    _check(LLM.from_backend(backend, CHUNKED), decoder, "last")


@needs_mlx
def test_inputs_one_at_a_time_in_a_pool_that_holds_one(models):
    """A pool of 3 blocks holds one 40-token input: the second waits for the first's blocks (freed as its vector is
    taken) and overwrites them; its mean must see none of the first's keys."""
    from backends.mlx.backend import MLXBackend

    decoder, model = models("mean")
    config = EngineConfig(num_kv_blocks=3, scheduler=SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=8))
    llm = LLM.from_backend(MLXBackend(model, progress=False), config)
    prompts = [random_prompt(5, 40, 512), random_prompt(6, 40, 512)]
    outs = llm.embed(prompts)
    for p, out in zip(prompts, outs, strict=True):
        np.testing.assert_allclose(out.embedding, hf_embedding(decoder, p, "mean"), atol=1e-4, rtol=0)
    assert llm.engine.all_blocks_free()


@needs_mlx
def test_an_embedding_model_refuses_generation_and_a_generator_embedding(models, smollm):
    from backends.mlx.backend import MLXBackend

    llm = LLM.from_backend(MLXBackend(models("last")[1], progress=False), EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.embed([[1] * 257])
    generator = LLM.from_backend(MLXBackend(smollm, progress=False), EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="needs an embedding model"):
        generator.embed("hello")


def _folder(tmp_path, modules: list[dict] | None, pool: dict | None = None):
    tmp_path.mkdir()
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pool is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    return tmp_path


ST = "sentence_transformers.models."
POOL = {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}


def test_pooling_files_and_tasks(tmp_path):
    hf = {"hidden_size": 32}
    plain = _folder(tmp_path / "plain", None)
    assert read_pooling(plain, hf) is None and read_pooling(plain, hf, "generate") is None
    assert read_pooling(plain, hf, "embed") == Pooling("last", True, 32)  # Qwen3-Embedding's pooling by default
    assert read_pooling(plain, {**hf, "matryoshka_dimensions": [16, 8]}, "pooling") == \
        Pooling("last", True, 32, True, (8, 16))
    mean = _folder(tmp_path / "mean", [POOL], {"pooling_mode_mean_tokens": True})
    assert read_pooling(mean, hf) == Pooling("mean", False, 32)  # no Normalize module
    assert read_pooling(mean, hf, "generate") is None
    with pytest.raises(NotImplementedError, match="pooling_mode_max_tokens"):
        read_pooling(_folder(tmp_path / "max", [POOL], {"pooling_mode_max_tokens": True}), hf)
    with pytest.raises(NotImplementedError, match="Dense"):
        read_pooling(_folder(tmp_path / "dense", [POOL, {"path": "2_Dense", "type": ST + "Dense"}],
                             {"pooling_mode_cls_token": True}), hf)
    with pytest.raises(ModelFormatError, match="exactly one"):
        read_pooling(_folder(tmp_path / "two", [POOL], {"pooling_mode_cls_token": True,
                                                       "pooling_mode_lasttoken": True}), hf)
    with pytest.raises(ValueError, match="--task must be one of"):
        task_of("classify")
    m = Pooling("last", True, 32, True, (8, 16))
    m.check_dimensions(8)
    for bad, words in [(12, r"one of \[8, 16\]"), (64, "one of")]:
        with pytest.raises(ValueError, match=words):
            m.check_dimensions(bad)
    with pytest.raises(ValueError, match="between 1 and 32"):
        Pooling("last", True, 32, True).check_dimensions(33)
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        Pooling("last", True, 32).check_dimensions(8)


@needs_mlx
def test_a_gguf_embedding_model(models, tmp_path):
    """llama.cpp's layout of an embedding model: qwen3 tensors without output.weight, qwen3.pooling_type LAST."""
    import gguf
    from gguf_write import add_rms_decoder, add_tensor, finish
    from test_tiny_gguf import gguf_name

    from backends.mlx.backend import MLXBackend

    decoder, _ = models("last")
    cfg, path = decoder.config, tmp_path / "embed.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_rms_decoder(w, cfg)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_pooling_type(gguf.PoolingType.LAST)
    for name, t in decoder.state_dict().items():
        add_tensor(w, gguf_name(f"model.{name}"), t.numpy())
    finish(w)
    model = load_model(path, progress=False)
    assert model.pooling == Pooling("last", True, 64)
    assert load_model(path, progress=False, task="generate").pooling is None
    _check(LLM.from_backend(MLXBackend(model, progress=False), CHUNKED), decoder, "last")


def test_cli_task_flags(models, capsys, monkeypatch):
    from frontend import cli
    from frontend.cli import main, parse_args

    monkeypatch.setattr(cli, "setup_logging", lambda _log: None)  # the root logger stays pytest's

    assert parse_args(["--runner", "pooling"]).task == "embed" and parse_args([]).task == "auto"
    assert parse_args(["--task", "embed", "--runner", "pooling"]).task == "embed"
    with pytest.raises(SystemExit):
        parse_args(["--task", "generate", "--runner", "pooling"])
    assert "disagree" in capsys.readouterr().err
    folder = str(models("last")[1].path)
    assert main(["--w", folder, "--prompt", "hi", "--mem", "4"]) == 2
    assert "embedding model" in capsys.readouterr().err
