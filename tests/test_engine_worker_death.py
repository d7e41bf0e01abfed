"""A tensor-parallel worker that exits while rank 0's step waits on a collective its transport cannot fail (MLX's
ring can wait for a dead peer for ever): the engine process ends itself after a grace and tells the API process why
(EngineCore.worker_died, core._die_now). The server-level case is tests/test_tensor_parallel_server.py's killed
worker, which hits this path in a few runs out of ten on a loaded machine."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import zmq

from backends.tp_processes import WorkerDied
from frontend.engine_proc import core
from frontend.engine_proc.core import EngineCore
from frontend.engine_proc.wire import Codec, Dead
from tests.serving import ROOT, child_env


def core_in_a_step() -> EngineCore:
    c = EngineCore(None, None, None, Codec(), 0)  # worker_died reads only the loop's clock and step flag
    c.in_step = True
    return c


def test_a_step_that_never_ends_ends_the_process_with_the_reason():
    c, said = core_in_a_step(), []
    start = time.monotonic()
    c.worker_died(WorkerDied("tensor-parallel worker rank 1 (pid 7) exited with code -9"), said.append)
    assert said == ["tensor-parallel worker rank 1 (pid 7) exited with code -9 during a step"]
    assert time.monotonic() - start >= core._STUCK_STEP_S  # the loop's own path had its chance first


def test_a_step_that_fails_by_itself_is_left_to_the_loop(monkeypatch):
    monkeypatch.setattr(core, "_STUCK_STEP_S", 10.0)  # a loaded machine may run the timer late: it need not race
    c, said = core_in_a_step(), []
    threading.Timer(0.05, lambda: setattr(c, "in_step", False)).start()  # the step raised: the loop says why
    c.worker_died(WorkerDied("rank 1 exited"), said.append)
    assert said == []
    c.in_step = False  # idle: the idle check says why
    c.worker_died(WorkerDied("rank 1 exited"), said.append)
    assert said == []


def test_die_now_delivers_dead_and_exits_1():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        code = f"from frontend.engine_proc.core import _die_now; _die_now('tcp://127.0.0.1:{port}', 'rank 1 exited')"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), timeout=60)
        assert proc.returncode == 1
        assert pull.poll(5000), "no message reached the API side"
        msg = Codec().from_engine.decode(pull.recv())
        assert isinstance(msg, Dead) and msg.message == "the engine process died: rank 1 exited"
    finally:
        pull.close(linger=0)
        ctx.term()
