"""Tensor parallel on MLX's CPU build: 2 processes joined by mx.distributed's ring (TCP on 127.0.0.1) give the
greedy tokens of one MLX process and first-step logits within 1e-5 of max|logit| (fp32), on tiny llama, qwen3 and
qwen2_moe models (vocab-parallel embedding and head, KV heads split, each expert split inside). MLX joins one ring a
process, so each case's rank 0 is a process of its own (tests/mlx_tp_driver.py). A ring that cannot start fails
with its reason, never a hang."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backend_greedy import backend_greedy
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)
from tiny_hf import assert_close, save_tiny_chat_qwen3

from ir.loader import load_model
from ir.reference import ReferenceRunner
from tests.serving import ROOT, child_env

mx = pytest.importorskip("mlx.core")
pytestmark = pytest.mark.skipif(not mx.distributed.is_available(), reason="this MLX build has no mx.distributed")

TP_TOL = 1e-5  # of max|logit|: the ranks' partial sums added in another order; a wrong shard moves whole units
NEW, BLOCK = 2, 4  # a prefill of both prompts, then a decode step over their cached tokens


def one_process(model, prompts: list[list[int]]):
    from backends.mlx.backend import MLXBackend

    backend = MLXBackend(model, dtype="f32", progress=False)
    return backend_greedy(backend, ReferenceRunner(model, max_tokens=48, block_size=BLOCK), prompts, NEW, BLOCK)


def rank0(folder, tmp_path, prompts: list[list[int]], **spec) -> dict:
    """tests/mlx_tp_driver's results: rank 0 of 2 in a process of its own."""
    out = tmp_path / "rank0.npz"
    run = subprocess.run([sys.executable, "-m", "tests.mlx_tp_driver", str(folder), "2", str(out),
                          json.dumps({"prompts": prompts, "new": NEW, **spec})], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(out) as got:
        return {k: got[k] for k in got.files}


@pytest.mark.parametrize("case", ["llama3_rope", "qwen3", "qwen2_moe"])
def test_two_ring_processes_match_one(case, saved, tmp_path):  # noqa: F811
    folder = saved(case)[1]
    prompts = [prompt(1), prompt(2, 9)]
    got = rank0(folder, tmp_path, prompts, then_kill=case == "qwen3")
    tokens, first = one_process(load_model(folder, progress=False), prompts)
    assert int(got["kv_heads"]) == 1  # each rank caches its one of the two KV heads
    assert got["tokens"].tolist() == tokens
    assert_close(got["first"], first, TP_TOL)
    if case == "qwen3":  # then rank 1 killed: the next call fails naming it, and the engine would stop
        assert re.match(r"WorkerDied: tensor-parallel worker rank 1 \(pid \d+\) exited with code -9",
                        str(got["error"])), got["error"]
        assert bool(got["fatal"])


@pytest.mark.parametrize("case", ["gqa9_3", "mha3"])
def test_heads_split_unevenly_over_the_ring(case, saved, tmp_path):  # noqa: F811
    """3 KV groups over 2 ranks (9 / 3 and 3 / 3 heads): rank 0 holds two, rank 1 one (ir.sharding's KV groups)."""
    folder = saved(case)[1]
    prompts = [prompt(1), prompt(2, 9)]
    got = rank0(folder, tmp_path, prompts)
    tokens, first = one_process(load_model(folder, progress=False), prompts)
    assert int(got["kv_heads"]) == 2
    assert got["tokens"].tolist() == tokens
    assert_close(got["first"], first, TP_TOL)


SMOL_PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1562, 25, 8, 44, 99, 1005, 23, 32, 3000]]


def test_smollm2_over_two_ring_processes(smollm_path, tmp_path):
    """SmolLM2-135M (9 query / 3 KV heads, Q4_1 blocks cut per rank) over 2 ranks: one process's greedy tokens."""
    got = rank0(smollm_path, tmp_path, SMOL_PROMPTS)
    tokens, first = one_process(load_model(smollm_path, progress=False), SMOL_PROMPTS)
    assert int(got["kv_heads"]) == 2
    assert got["tokens"].tolist() == tokens
    assert_close(got["first"], first, TP_TOL)


def test_a_ring_that_cannot_start_says_why(saved):  # noqa: F811
    """Rank 0's port already taken: start fails at once with MLX's reason, and its worker is stopped."""
    from backends.mlx import distributed, tensor_parallel

    model = load_model(saved("qwen3")[1], progress=False)
    with socket.socket() as busy, socket.socket() as spare:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        spare.bind(("127.0.0.1", 0))
        hosts = [f"127.0.0.1:{s.getsockname()[1]}" for s in (busy, spare)]
        spare.close()
        with pytest.raises(RuntimeError, match=rf"MLX's ring could not start: rank 0 at {hosts[0]}.*in use"):
            tensor_parallel.start(model, 2, hosts, dtype="f32", progress=False)
    assert distributed._GROUP is None
    with pytest.raises(ValueError, match="power of two"):
        tensor_parallel.start(model, 3)
    with pytest.raises(ValueError, match=r"layers.0.wq \[64, 64\] has 4 heads"):
        tensor_parallel.start(model, 8)


def ring_ports() -> int:
    """A port p with p + 1 free too (mlx.launch gives rank r the port p + r)."""
    for _ in range(20):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two consecutive free ports")


def test_cli_tp_2_answers_as_one_process(tmp_path, smollm_path):
    """`--tp 2` through the engine (rank 0 in the CLI's process, its worker spawned), and 2 ranks started by
    mlx.launch (MLX_RANK, MLX_HOSTFILE: rank 1 serves rank 0's steps), give one process's greedy answer."""
    save_tiny_chat_qwen3(tmp_path, smollm_path)

    def answer(*argv: str, launch: list[str] = ()) -> tuple[str, str]:
        run = subprocess.run([*launch, sys.executable, "-m", "frontend", "--w", str(tmp_path), *argv, "--prompt",
                              "Hello there", "--max-tokens", "8", "--temperature", "0", "--dtype", "f32", "--mem", "8"],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout, run.stderr

    one, _ = answer("--backend", "mlx")
    two, log = answer("--tp", "2")
    assert one.strip() and two == one
    assert "mlx tensor parallel: 2 ranks over the ring" in log
    launcher = Path(sys.executable).parent / "mlx.launch"
    launched, log = answer(launch=[str(launcher), "--backend", "ring", "-n", "2", "-p", str(ring_ports()), "--"])
    assert launched == one  # rank 0's answer alone: rank 1 prints nothing
    assert "rank 1 of 2 of MLX's ring, serving rank 0's steps" in log


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "power of two from 1 to 8 processes, not 3"),
    (["--tp", "2", "--backend", "cuda"], "--tp N is the MLX backend's tensor parallel"),
    (["--tp", "2", "--d", "0,1"], "--tp N is the MLX backend's tensor parallel"),
])
def test_cli_refuses_a_bad_tp(argv, message, capsys):
    from frontend.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--w", ".", *argv])
    assert message in capsys.readouterr().err


def test_cli_refuses_an_unreadable_mlx_launch_hostfile(tmp_path, monkeypatch, capsys):
    from frontend.cli import parse_args

    bad = tmp_path / "hosts.json"
    bad.write_text("[127.0.0.1:5000")
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(bad))
    with pytest.raises(SystemExit):
        parse_args(["--w", "."])
    assert f"MLX_HOSTFILE {bad} (a JSON list of each rank's \"ip:port\" list) do not make a ring" in \
        capsys.readouterr().err
