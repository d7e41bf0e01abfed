"""Starting an engine process and waiting until it is ready: the API process's side of the start-up handshake.

The process is spawned, never forked: CUDA forbids a fork after it is initialised, and a fresh interpreter loads
the backend once, in the process that owns the device memory. The API process binds both sockets (IPC, in a folder
of its own) and the engine connects; every engine process gets new ones, so a restarted engine never reads what was
meant for the one before.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import zmq

from frontend.engine_proc import core
from frontend.engine_proc.spec import EngineSpec
from frontend.engine_proc.wire import Codec, Inputs, LoadFailed, Ready

log = logging.getLogger("frontend")
_POLL_MS = 100


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why) or ended before it was ready."""


def exit_description(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class EngineProcess:
    """One engine process and the two sockets that talk to it."""

    def __init__(self, spec: EngineSpec):
        self.folder = tempfile.mkdtemp(prefix="llm-engine-")
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PUSH)  # API -> engine
        self.inputs.setsockopt(zmq.SNDHWM, 0)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.bind(f"ipc://{self.folder}/inputs")
        self.outputs = self.ctx.socket(zmq.PULL)  # engine -> API
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(f"ipc://{self.folder}/outputs")
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=core.main, name="engine", daemon=True,
                               args=(spec, f"ipc://{self.folder}/inputs", f"ipc://{self.folder}/outputs", os.getpid()))
        self.ready: Ready | None = None
        self._stopped = False

    @classmethod
    def start(cls, spec: EngineSpec) -> EngineProcess:
        """Spawns the engine and returns once it has loaded the model; EngineStartError if it cannot."""
        self = cls(spec)
        try:
            self.proc.start()
            log.info("engine process started (pid %d); loading the model there", self.proc.pid)
            self.ready = self._wait_ready(Codec())
        except BaseException:  # a load failure, or Ctrl-C while loading: no engine is left behind
            self.stop(timeout=5)
            raise
        log.info("engine process ready (pid %d)", self.pid)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, codec: Codec) -> Ready:
        while True:
            if self.outputs.poll(_POLL_MS):
                msg = codec.from_engine.decode(self.outputs.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, LoadFailed):
                    raise EngineStartError(msg.message)
                raise EngineStartError(f"the engine process sent {type(msg).__name__} before it was ready")
            if not self.proc.is_alive():
                raise EngineStartError(f"the engine process {exit_description(self.proc.exitcode)} while loading "
                                       "the model (its log is above)")

    def stop(self, timeout: float = 10) -> None:
        """Asks the engine to stop, then makes sure it has: terminate, then kill. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.proc.pid is not None and self.proc.is_alive():
            try:
                self.inputs.send(Codec().encode(Inputs(stop=True)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            self.proc.join(timeout)
            for kill in (self.proc.terminate, self.proc.kill):
                if not self.proc.is_alive():
                    break
                log.warning("the engine process (pid %d) did not stop in time; ending it", self.proc.pid)
                kill()
                self.proc.join(max(1.0, deadline - time.monotonic()))
        elif self.proc.pid is not None:
            self.proc.join(0)
        self.inputs.close()
        self.outputs.close()
        self.ctx.term()
        shutil.rmtree(self.folder, ignore_errors=True)
