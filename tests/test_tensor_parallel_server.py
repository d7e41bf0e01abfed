"""The server with `--d 0,1` on CPU tensors (test only: --cpu-tensors, gloo, Triton's interpreter), and with
`--tp 2` on MLX (its ring): a tiny random qwen3 with SmolLM2's vocabulary and tokenizer, served under SmolLM2's
name, answers the README's curl example (its max_tokens cut to 4: on CUDA every step runs under the interpreter in
two processes); a worker killed in the middle of a request fails that request, and /health says 503 within a second
(the engine is then restarted)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
from test_engine_process import health
from tiny_hf import save_tiny_chat_qwen3

from tests.serving import ServerProcess, readme_blocks

TWO_RANKS = {
    "cuda": pytest.param(("--d", "0,1", "--cpu-tensors"), id="cuda", marks=pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed")),
    "mlx": pytest.param(("--backend", "mlx", "--tp", "2"), id="mlx", marks=pytest.mark.skipif(
        importlib.util.find_spec("mlx") is None, reason="mlx is not installed")),
}


@pytest.fixture(scope="module", params=TWO_RANKS.values())
def server(request, tmp_path_factory, smollm_path):
    folder = tmp_path_factory.mktemp("tp") / "SmolLM2-135M-Instruct"  # the name the README's example asks for
    save_tiny_chat_qwen3(folder, smollm_path)
    with ServerProcess("--w", str(folder), *request.param, "--dtype", "f32", "--mem", "8",
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
    killed = time.monotonic()
    while health(server) != 503:
        assert time.monotonic() - killed < 1.0, "/health did not say 503 within a second\n" + server.log()[-3000:]
        time.sleep(0.02)
    request.join(30)
    error = json.loads(result["r"].stdout)["error"]
    assert "rank 1" in error["message"] and "exited" in error["message"], error
