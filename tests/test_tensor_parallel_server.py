"""The server with `--d 0,1` on CPU tensors (test only: --cpu-tensors, gloo, Triton's interpreter), and with
`--tp 2` on MLX (its ring): a tiny random qwen3 with SmolLM2's vocabulary and tokenizer, served under SmolLM2's
name, answers the README's curl example (its max_tokens cut to 4: on CUDA every step runs under the interpreter in
two processes); a worker killed in the middle of a request fails that request, and /health says 503 within a second
(the engine is then restarted); one killed while no request runs turns /health 503 within a second too. The
README's two-host torchrun launch, its hosts two local processes on CPU tensors, answers a prompt
as the interpreter does."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_engine_process import await_health
from tiny_hf import save_tiny_chat_qwen3

from ir.loader import load_model
from ir.reference import ReferenceRunner
from tests.serving import ROOT, ServerProcess, child_env, free_port, readme_blocks

# TEST_TP_DEVICE=cuda (tools/gpu_check.sh's tests_tp step): the CUDA case on GPUs 0 and 1 over NCCL instead
ON_CUDA = os.environ.get("TEST_TP_DEVICE") == "cuda"
TWO_RANKS = {
    "cuda": pytest.param(("--d", "0,1", *(() if ON_CUDA else ("--cpu-tensors",))), id="cuda", marks=pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed")),
    "mlx": pytest.param(("--backend", "mlx", "--tp", "2"), id="mlx", marks=pytest.mark.skipif(
        importlib.util.find_spec("mlx") is None, reason="mlx is not installed")),
}


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, smollm_path):
    folder = tmp_path_factory.mktemp("tp") / "SmolLM2-135M-Instruct"  # the name the README's example asks for
    save_tiny_chat_qwen3(folder, smollm_path)
    return folder


@pytest.fixture(scope="module", params=TWO_RANKS.values())
def server(request, tiny_chat):
    with ServerProcess("--w", str(tiny_chat), *request.param, "--dtype", "f32", "--mem", "8",
                       "--on-engine-death", "restart") as s:
        yield s


def chat(server: ServerProcess, max_tokens: int) -> subprocess.CompletedProcess:
    curl = readme_blocks("sh", "curl").replace("127.0.0.1:2000", f"127.0.0.1:{server.port}")
    curl = curl.replace('"max_tokens": 32', f'"max_tokens": {max_tokens}')
    return subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)


def test_readme_curl_example_on_two_processes(server):
    r = chat(server, 4)
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["message"]["content"], answer
    assert re.search(r"tp-worker pid \d+ .*rank 1 of 2", server.log())


def test_a_killed_worker_fails_its_request_and_health(server):
    (pid,) = map(int, re.findall(r"tp-worker pid (\d+) .*rank 1 of 2", server.log()))
    result = {}
    request = threading.Thread(target=lambda: result.update(r=chat(server, 200)))  # still running at 2 s
    request.start()
    time.sleep(2)  # into its decode steps
    os.kill(pid, signal.SIGKILL)
    await_health(server, 503, 1.0, "/health did not say 503 within a second", poll_s=0.02)
    request.join(30)
    error = json.loads(result["r"].stdout)["error"]
    assert "rank 1" in error["message"] and "exited" in error["message"], error


def test_a_worker_killed_while_idle_is_noticed_at_once(server):
    """No request running: the idle engine's watch (not the next request) ends it, and a request gets an error."""
    await_health(server, 200, 60, "the previous test's engine was not restarted")
    assert chat(server, 1).returncode == 0
    pid = int(re.findall(r"tp-worker pid (\d+) .*rank 1 of 2", server.log())[-1])
    os.kill(pid, signal.SIGKILL)
    await_health(server, 503, 1.0, "/health did not say 503 within a second", poll_s=0.02)
    error = json.loads(chat(server, 4).stdout)["error"]
    assert error["message"], error
    assert re.search(rf"rank 1 \(pid {pid}\) exited .* while the engine was idle", server.log())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_readme_two_host_torchrun_launch(tiny_chat, tmp_path):
    """The README's command on each "host" (node rank 0 and 1, one process each, meeting at 127.0.0.1): rank 0
    answers --prompt with the one-process reference's greedy tokens, rank 1 runs its steps, both exit cleanly."""
    block = readme_blocks("sh", "torchrun --nnodes 2")
    argv = shlex.split(" ".join(line for line in block.splitlines() if not line.startswith("#")).replace("\\", ""))
    assert argv[:3] == ["torchrun", "--nnodes", "2"] and argv[-4:] == ["--m", "Qwen/Qwen3-8B", "--h", "0.0.0.0"]
    text, new, port = "What is the capital of France?", 3, str(free_port())
    ours = ["--w", str(tiny_chat), "--cpu-tensors", "--dtype", "f32", "--mem", "8", "--prompt", text, "--max-tokens",
            str(new), "--temperature", "0"]

    def host(node_rank: int) -> subprocess.Popen:
        """torchrun's flags as the README gives them, but one process a host and the hosts this machine."""
        given = {"--nproc-per-node": "1", "--node-rank": str(node_rank), "--master-addr": "127.0.0.1",
                 "--master-port": port}
        flags = [given.get(argv[i - 1], a) for i, a in enumerate(argv[:-4]) if i]
        out, err = (open(tmp_path / f"host{node_rank}.{x}", "w") for x in ("out", "err"))
        with out, err:  # the child keeps its own copies
            return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, *ours], cwd=ROOT,
                                    env=child_env(), stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    hosts = [host(0), host(1)]
    try:
        codes = [p.wait(180) for p in hosts]
    finally:
        for p in hosts:
            p.kill()
    out, err = ([(tmp_path / f"host{r}.{x}").read_text() for r in (0, 1)] for x in ("out", "err"))
    assert codes == [0, 0], [e[-3000:] for e in err]
    assert "rank 1 of 2 on cpu, serving rank 0's steps" in err[1]
    model = load_model(tiny_chat, progress=False)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    tokens, _ = ReferenceRunner(model, max_tokens=len(ids) + new + 8).greedy([ids], new)
    assert out[0] == model.tokenizer.decode(tokens[0]) + "\n" and out[1] == ""
