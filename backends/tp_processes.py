"""Tensor parallel's processes, whatever carries the collectives (torch.distributed on the CUDA backend,
mx.distributed on MLX): rank 0 (the engine's process) spawns ranks 1.. as fresh interpreters, watches them, and
sends them every backend call that runs the graph; a worker replays them in order. How a message travels and how
a group is joined or left are the backend's (`Channel`).

A worker that exits fails rank 0's next call, or the collective waiting for it (WorkerDied), and the engine stops
(the backend's is_fatal): an error, never a hang. An idle engine polls `Workers.check` (Backend.check_alive)."""

from __future__ import annotations

import base64
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_ENV = "LLM_ENGINE_TP_WORKER"  # a worker's spec, pickled and base64-encoded
STOP_WAIT_S = 10


class WorkerDied(RuntimeError):
    pass


@dataclass(frozen=True)
class Channel:
    """A backend's transport: `send` delivers rank 0's message to every worker, `leave` leaves the group, `abort`
    fails the collectives in flight (where the transport would otherwise wait for a dead peer)."""

    send: Callable[[object], None]
    leave: Callable[[], None]
    abort: Callable[[], None] = lambda: None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Ranks 1.. as rank 0 sees them: their processes (none under a launcher) and the channel to them."""

    def __init__(self, procs: dict[int, subprocess.Popen], channel: Channel):
        self.procs = procs
        self.channel = channel
        self.stopped = self.closing = False
        self.on_death: Callable[[WorkerDied], None] | None = None  # the engine's (Backend.on_worker_death)

    def check(self) -> None:
        for rank, p in self.procs.items():
            if p.poll() is not None:
                raise WorkerDied(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.returncode}")

    def watch(self, every_s: float = 0.1) -> None:
        """In the background: a worker that exits aborts the group at once (NCCL's collectives would wait)."""
        def run() -> None:
            while not self.closing:
                try:
                    self.check()
                except WorkerDied as e:
                    if not self.closing:
                        log.error("%s; aborting the tensor-parallel group", e)
                        self.channel.abort()
                        if self.on_death is not None:  # a collective the abort could not fail still waits
                            self.on_death(e)
                    return
                time.sleep(every_s)

        if self.procs:
            threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def explain(self, error: BaseException, wait_s: float = 1.0) -> None:
        """WorkerDied from `error` (a failed collective) if a worker exits within wait_s; else nothing."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check()
            except WorkerDied as died:
                raise WorkerDied(f"{died} during a step") from error
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def send(self, method: str, *args, **kwargs) -> None:
        """Every worker runs backend.method(*args, **kwargs), as rank 0 is about to."""
        if self.stopped:
            raise WorkerDied("the tensor-parallel workers were stopped")
        self.check()
        self.channel.send((method, args, kwargs))

    def close(self, joined: bool = True) -> None:
        """Stop the workers: told to when the group was `joined`, then killed after STOP_WAIT_S (at once if not)."""
        if self.stopped:
            return
        self.closing = True  # the workers' exits that follow are expected (watch)
        if joined:
            try:
                self.send("stop")
            except Exception:  # noqa: BLE001  (a worker already gone: the rest are killed below)
                pass
        self.stopped = True
        for p in self.procs.values():
            try:
                p.wait(STOP_WAIT_S if joined else 0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if joined:
            self.channel.leave()


def spawn(module: str, spec: dict, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m module` as a worker, its spec in WORKER_ENV, importing this checkout's code (not another)."""
    root = str(Path(__file__).resolve().parents[1])
    encoded = base64.b64encode(pickle.dumps(spec)).decode()
    env = {**os.environ, **(env or {}), WORKER_ENV: encoded,
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen([sys.executable, "-m", module], env=env, cwd=root, stdin=subprocess.DEVNULL)


def worker_spec() -> dict:
    """The spec rank 0 gave this worker (spawn)."""
    return pickle.loads(base64.b64decode(os.environ[WORKER_ENV]))


def join(init: Callable[[], None], workers: Workers) -> None:
    """Run `init` (joining the group), watching the workers: one that dies before it joins fails this at once."""
    done, error = threading.Event(), []

    def run() -> None:
        try:
            init()
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="tp-join", daemon=True).start()
    while not done.wait(0.1):
        workers.check()
    if error:
        raise error[0]


def serve(backend, receive: Callable[[], object]) -> None:
    """A worker's loop: rank 0's calls, in order, until it says stop (or the group fails: rank 0 is gone)."""
    while True:
        method, args, kwargs = receive()
        if method == "stop":
            return
        getattr(backend, method)(*args, **kwargs)


def worker_logging() -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s tp-worker pid %(process)d %(name)s: %(message)s")
