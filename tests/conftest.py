"""Shared fixtures. Torch (the numerical reference) gets one thread: on a 2-core machine its default
thread pool spins and slows every other test down. OpenBLAS (numpy's, and MLX's through backends/mlx/fast_blas)
gets the cores divided among the xdist workers, for the same reason."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # OpenBLAS's threads spin while they wait: with every worker (and each server process a test starts) running a
    # pool as wide as the machine, a 2-core run of `make test` took 30 minutes instead of 17. Set here, in the
    # controller, before xdist starts the workers, so that they (and their children) load OpenBLAS with it.
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 0:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm_path():
    from ir.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """Our loaded SmolLM2 GGUF."""
    from ir.loader import load_model

    return load_model(smollm_path, progress=False)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own reading of the same GGUF, dequantized to fp32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def mlx_smollm(smollm):
    """SmolLM2 on the MLX backend (dense fp32 on CPU), shared by engine tests: each engine
    re-allocates the KV cache it needs."""
    from backends.mlx.backend import MLXBackend

    # The compiled decode step is the Metal default; the CPU suite runs it too, so that it stays correct.
    return MLXBackend(smollm, progress=False, compile=os.environ.get("ENGINE_MLX_COMPILE", "1") == "1")


@pytest.fixture
def make_engine(mlx_smollm):
    """Builds engines over the shared backend and checks, after the test, that every KV block is free."""
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    engines = []

    def make(backend=None, **kw):
        sched = {k: kw.pop(k) for k in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size") if k in kw}
        kw.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(backend or mlx_smollm, EngineConfig(scheduler=SchedulerConfig(**sched), **kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert not engine.has_unfinished(), "a test left requests unfinished"
        assert engine.all_blocks_free(), f"{engine.blocks.num_free_blocks}/{engine.blocks.num_blocks} blocks free"
