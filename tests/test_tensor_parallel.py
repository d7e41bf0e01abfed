"""Tensor parallel over processes on CPU tensors: rank 0 here, ranks 1.. spawned (backends.cuda.tensor_parallel),
gloo between them, the DSL's kernels on Triton's interpreter. Tiny llama, qwen3, windowed mistral and qwen2_moe
(routed experts split inside each expert, a gated shared expert, a dense layer) models over 2 and 4 processes (at 4
the 2 KV heads replicated), give the greedy tokens of one process and first-step logits within 1e-5 of
max|logit| (fp32). A worker killed in the middle of a request: test_tensor_parallel_server.

TEST_TP_DEVICE=cuda (tools/gpu_check.sh's tests_tp step) puts the ranks on GPUs cuda:0.. over NCCL, CUDA graphs
captured with the all-reduces inside, and holds them to one GPU's backend (the one-process reference is then
test_cuda_backend's); a world past the GPUs present is skipped."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from backend_greedy import backend_greedy
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)
from tiny_hf import assert_close

from ir.loader import load_model
from ir.reference import ReferenceRunner
from ir.sharding import shard

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")

ON_CUDA = os.environ.get("TEST_TP_DEVICE") == "cuda"
TP_TOL = 1e-5  # of max|logit|: sums over ranks in another order; a wrong shard moves logits by whole units
NEW = 2  # a prefill of both prompts, then a decode step over their cached tokens


def greedy(backend, model, prompts, new: int):
    return backend_greedy(backend, ReferenceRunner(model, max_tokens=48, block_size=4), prompts, new, 4)


def start(model, world: int):
    from backends.cuda import tensor_parallel

    devices = [f"cuda:{r}" for r in range(world)] if ON_CUDA else ["cpu"] * world
    return tensor_parallel.start(model, devices, dtype="f32", progress=False)


def one_process(model, prompts, new: int):
    """The tokens and first-step logits TP must give: the reference's on CPU, one GPU's backend on GPUs."""
    if not ON_CUDA:
        return ReferenceRunner(model, max_tokens=48, block_size=4).greedy(prompts, new)
    from backends.cuda.backend import CUDABackend

    return greedy(CUDABackend(model, dtype="f32", device="cuda:0", progress=False), model, prompts, new)


def assert_ranks_match_one(path, world: int, kv_heads: int, check=None) -> None:
    """`world` processes against the one-process reference on two prompts: identical greedy tokens, first logits
    within TP_TOL; rank 0 holds `kv_heads` KV heads, and `check(backend)` whatever else the case asks."""
    if ON_CUDA and world > torch.cuda.device_count():
        pytest.skip(f"{world} ranks need {world} GPUs; {torch.cuda.device_count()} here")
    model = load_model(path, progress=False)
    prompts, new = [prompt(1), prompt(2, 9)], NEW
    tokens, first = one_process(model, prompts, new)
    backend = start(model, world)
    try:
        assert backend.kv_layout().shapes[0].heads == kv_heads
        if check is not None:
            check(backend)
        tp_tokens, tp_first = greedy(backend, model, prompts, new)
    finally:
        backend.workers.close()
    assert tp_tokens == tokens
    assert_close(tp_first, first, TP_TOL)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["llama3_rope", "qwen3", "mistral_window", "qwen2_moe"])
def test_processes_match_one(case, world, saved):  # noqa: F811
    """Against the one-process reference (test_cuda_backend holds one process of this backend to it within 1e-4;
    here the ranks' backends, on the same kernels, are held to 1e-5)."""
    def check(backend):
        if case == "qwen2_moe":  # every rank holds all 8 experts, each its share of the 32 rows
            assert backend.rank_graph.params["layers.1.exp_gate"].shape == (8, 32 // world, 64)

    assert_ranks_match_one(saved(case)[1], world, max(1, 2 // world), check)  # the rank's share of the KV heads


@pytest.mark.parametrize("case, world, kv_heads", [("gqa9_3", 2, 2), ("gqa6_3", 2, 2), ("mha3", 2, 2),
                                                   ("gqa6_2", 4, 1)])
def test_heads_split_unevenly_match_one(case, world, kv_heads, saved):  # noqa: F811
    """3 KV groups over 2 processes (9 / 3, 6 / 3 and 3 / 3 heads): rank 0 holds two groups, rank 1 one, each with
    its GQA group of query heads; rank 0's cache, the larger, is the one it sizes. 6 / 2 over 4: each KV head on 2
    ranks that split its 3 query heads 2 / 1 (test_sharding checks the cuts)."""
    assert_ranks_match_one(saved(case)[1], world, kv_heads)


@pytest.mark.skipif(not ON_CUDA, reason="SmolLM2 on Triton's interpreter takes minutes; tests_tp runs it on GPUs")
def test_smollm2_over_two_processes():
    """SmolLM2-135M (9 query / 3 KV heads, Q4_1 blocks cut per rank) over 2 GPUs: one GPU's greedy tokens in fp32."""
    from ir.default_model import default_model_path

    if torch.cuda.device_count() < 2:
        pytest.skip(f"2 ranks need 2 GPUs; {torch.cuda.device_count()} here")
    try:
        smollm = load_model(default_model_path(), progress=False)
    except FileNotFoundError as e:  # gpu_check's image may lack the GGUF
        pytest.skip(str(e))
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1562, 25, 8, 44, 99, 1005, 23, 32, 3000]]
    tokens, first = one_process(smollm, prompts, 8)
    backend = start(smollm, 2)
    try:
        assert backend.kv_layout().shapes[0].heads == 2
        tp_tokens, tp_first = greedy(backend, smollm, prompts, 8)
    finally:
        backend.workers.close()
    assert tp_tokens == tokens
    assert_close(tp_first, first, TP_TOL)


def test_heads_that_do_not_split_are_refused_before_any_process_starts(saved):  # noqa: F811
    model = load_model(saved("qwen3")[1], progress=False)
    with pytest.raises(ValueError, match=r"layers.0.wq \[64, 64\] has 4 heads"):
        start(model, 8)
    with pytest.raises(ValueError, match="power of two"):
        start(model, 3)
    np.testing.assert_equal(torch.distributed.is_initialized(), False)


def children() -> set[int]:
    """This process's child processes (from /proc; none where there is no /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that exited while we looked
            continue
        if ppid == os.getpid():
            out.add(int(stat.parent.name))
    return out


def test_one_gpu_id_is_the_one_process_path(saved):  # noqa: F811
    """`--d 0` (on CPU tensors here: --cpu-tensors) builds one CUDABackend over the whole graph: no worker spawned,
    no group joined, no collective in the graph it runs. tools/bench_gpu --d 0 builds it the same way."""
    from backends.base import create_backend
    from backends.cuda.backend import CUDABackend
    from frontend.cli import backend_options, parse_args
    from tools.bench_gpu import cli_options

    assert cli_options("0") == backend_options(parse_args(["--d", "0"])) == {"device": "cuda:0"}
    assert cli_options("0,1") == {"device": ["cuda:0", "cuda:1"]}  # tensor parallel (tests/test_bench_gpu_tp.py)
    args = parse_args(["--d", "0", "--cpu-tensors"])
    assert backend_options(args) == {"device": "cpu"}
    model = load_model(saved("qwen3")[1], progress=False)
    before = children()
    backend = create_backend(args.backend, model, dtype="f32", progress=False, **backend_options(args))
    assert type(backend) is CUDABackend and (backend.world, backend.workers, backend.mirror) == (1, None, None)
    assert backend.rank_graph is model.graph and shard(model.graph, 0, 1) is model.graph  # the pass: a no-op
    assert not {"all_reduce", "all_gather"} & {n.op for n in backend.graph.nodes}
    assert children() == before and not torch.distributed.is_initialized()
