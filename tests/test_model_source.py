"""--m/--f/--w resolution: hub ids through huggingface_hub's cache (offline here), and clear refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from frontend.model_source import DEFAULT_ID, ModelNotFound, resolve
from tests.serving import ROOT
from tests.tiny_chat_model import GGUF_REPO, REPO, SNAPSHOT, hub_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm_path):
    return hub_cache(tmp_path_factory.mktemp("hf-cache"), smollm_path)


@pytest.fixture
def offline_cache(cache, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_resolve_from_the_cache(offline_cache, smollm_path):
    src = resolve(model=REPO)
    assert src.id == REPO and src.path.name == SNAPSHOT and (src.path / "config.json").exists()
    gguf = resolve(model=GGUF_REPO, file=smollm_path.name)
    assert gguf.path.name == smollm_path.name and gguf.path.resolve() == smollm_path.resolve()


def test_missing_models_are_named(offline_cache, tmp_path):
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve(model="nobody/nothing")
    with pytest.raises(ModelNotFound, match="no config.json.*--f"):
        resolve(model=GGUF_REPO)
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve(file=str(tmp_path / "missing.gguf"))


def test_local_paths_and_default(smollm_path, tmp_path):
    assert resolve().id == DEFAULT_ID and resolve().path == smollm_path
    assert resolve(file=str(smollm_path)).id == smollm_path.stem
    assert resolve(model=str(smollm_path.parent), file=smollm_path.name).path == smollm_path
    assert resolve(weights=str(tmp_path)).id == tmp_path.name


def _cuda_usable() -> bool:
    from backends.base import _cuda_usable as usable

    return usable()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "frontend", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("args, words", [
    (["--m", "nobody/nothing"], "not in the local Hugging Face cache"),
    (["--f", "/no/such/model.gguf"], "no such file"),
    (["--isq", "q9"], "unknown --isq type 'q9'; expected one of q4_0"),
    (["--d", "0,1,2"], "power of two from 1 to 8 GPUs, not 3"),
    (["--d", "0,0"], "each once"),
    (["--kv-fraction", "1.5"], "(0, 1]"),
    (["--mem", "64", "--kv-fraction", "0.5"], "not both"),
    (["--backend", "cuda", "--f", "/no/such/model.gguf"], "no such file"),
    pytest.param(["--backend", "cuda", "--prompt", "hi"], "NVIDIA GPU", marks=pytest.mark.skipif(
        _cuda_usable(), reason="a GPU is usable here: the CUDA backend would start")),
    (["--block-size", "0"], "must be positive"),
    (["--top-p", "3"], "top_p"),
    (["--w", "x", "--f", "y.gguf"], "cannot be combined"),
])
def test_cli_refuses_clearly(args, words, cache):
    r = run_cli(*args, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    assert words in r.stderr and "Traceback" not in r.stderr


def test_unreachable_hub_is_said_plainly(offline_cache, monkeypatch):
    """Online mode with nothing listening where the hub should be: the error names the cache and the cause."""
    from huggingface_hub import constants

    from tests.serving import free_port
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache.*could not be reached"):
        resolve(model="nobody/nothing")
    assert resolve(model=REPO).path.name == SNAPSHOT  # a cached model still loads without asking the hub


def test_one_shot_prompt_answers_on_stdout():
    r = run_cli("--prompt", "What is the capital of France?", "--temperature", "0", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "Traceback" not in r.stderr


def test_engine_and_backend_flags_reach_their_configs():
    from frontend.cli import backend_options, engine_config, parse_args

    args = parse_args(["--disable-async-scheduling", "--disable-prefix-cache", "--disable-cuda-graph", "--kv-fraction",
                       "0.5", "--max-num-seqs", "8", "--block-size", "32", "--d", "1"])
    config = engine_config(args)
    assert (config.async_scheduling, config.prefix_caching, config.kv_fraction, config.block_size) == (
        False, False, 0.5, 32)
    assert config.scheduler.max_num_seqs == 8
    assert backend_options(args) == {"cuda_graph": False, "device": "cuda:1"}
    assert engine_config(parse_args([])).async_scheduling  # overlapped steps by default (where a backend can)


def test_tensor_parallel_flags_and_launcher_environment(monkeypatch):
    """--d with several ids: one device a rank; under torchrun each rank its LOCAL_RANK's GPU and the rendezvous."""
    from backends.cuda.distributed import Rendezvous
    from frontend.cli import backend_options, parse_args

    assert backend_options(parse_args(["--d", "0,1,2,3"]))["device"] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    args = parse_args(["--d", "0,1", "--cpu-tensors"])
    assert (args.backend, backend_options(args)) == ("cuda", {"device": ["cpu", "cpu"]})
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29400")
    args = parse_args([])
    assert backend_options(args) == {"device": ["cuda:1"], "rendezvous": Rendezvous(3, 4, "10.0.0.2", 29400, 1)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # Open MPI's mpirun names them its own way
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert backend_options(parse_args([]))["rendezvous"] == Rendezvous(1, 2, "10.0.0.2", 29400, 1)


@pytest.mark.parametrize("rank, world, words", [(0, 3, "the launcher's world size: tensor parallel runs on a power "
                                                       "of two from 1 to 8 processes, not 3"),
                                                (5, 2, "the launcher gave this process rank 5, not one of 0..1")])
def test_a_launch_that_does_not_fit_is_refused_by_every_rank(rank, world, words, monkeypatch, capsys):
    from frontend.cli import parse_args

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit):
        parse_args(["--cpu-tensors"])
    assert words in capsys.readouterr().err


def test_a_launch_refuses_restarting_the_engine(monkeypatch, capsys):
    """A restarted engine would wait for ranks that the launcher ended with the first (rank 0 spawns its own)."""
    from frontend.cli import parse_args

    assert parse_args(["--d", "0,1", "--on-engine-death", "restart"]).on_engine_death == "restart"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse_args(["--on-engine-death", "restart"])
    assert "could not rejoin them" in capsys.readouterr().err


def test_model_and_served_name_as_vllm_and_llama_server_spell_them(smollm_path):
    """`--model PATH --served-model-name NAME` (vLLM's flags; llama-server's --model and --alias): the file is served
    under NAME, which /v1/models lists and requests use; the file's own name is then not a model here."""
    from openai import NotFoundError, OpenAI

    from frontend import cli
    from tests.serving import FRANCE, ServerProcess

    assert cli.parser().parse_args(["--alias", "a", "--model", "x/y"]).served_model_name == "a"
    assert cli.parser().parse_args(["--model", "x/y"]).m == "x/y"
    with ServerProcess("--model", str(smollm_path), "--served-model-name", "smol", "--max-model-len", "512") as srv:
        client = OpenAI(base_url=srv.url, api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol"]
        r = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0, max_tokens=12)
        assert r.model == "smol" and "Paris" in r.choices[0].message.content
        with pytest.raises(NotFoundError, match="serves 'smol'"):
            client.chat.completions.create(model=smollm_path.stem, messages=FRANCE, max_tokens=2)
