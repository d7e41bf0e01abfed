"""A real server process on a free loopback port, for tests that drive it over HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that imports this repo: ROOT first on PYTHONPATH, the rest kept (a GPU
    machine finds its carried packages there)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m frontend ARGS` (or another `module` that serves as it does) on 127.0.0.1; `url` ends in /v1. Stops
    (and reports its log) on exit."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_s: float = 180,
                 module: str = "frontend"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        # TEST_SERVER_BACKEND=cuda runs the same server tests on the CUDA backend (tools/gpu_check.sh), in fp32:
        # these tests hold seeded and greedy answers to be the same whatever else is in the batch, which only fp32
        # keeps on a GPU (fp16 rounding differs between batch shapes; its accuracy is tests/test_cuda_backend.py's).
        backend = os.environ.get("TEST_SERVER_BACKEND")
        extra = ["--backend", backend] if backend and "--backend" not in args else []
        if backend == "cuda" and "--dtype" not in args:
            extra += ["--dtype", "f32"]
        self.args = ["--h", "127.0.0.1", "--p", str(self.port), *extra, *args]
        self.env = child_env(**(env or {}))
        self.startup_s = startup_s
        self.module = module
        self.log_path = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        import tempfile
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log", delete=False)
        self.log_path = self.log_file.name
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT, env=self.env,
                                     stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise TimeoutError(f"the server did not answer /health in {self.startup_s} s:\n{self.log()}")

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace") if self.log_path else ""

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name, labels dropped and their values summed (one model is served)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def post(server, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(server.base + path, data=data, headers={"Content-Type": "application/json",
                                                                         **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error_body(body: dict, param: str | None = None) -> str:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, body
    return err["message"]


def readme_blocks(lang: str, needle: str) -> str:
    text = (ROOT / "README.md").read_text()
    blocks = text.split(f"```{lang}\n")[1:]
    return next(b.split("```")[0] for b in blocks if needle in b)
