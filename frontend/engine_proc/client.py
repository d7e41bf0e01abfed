"""AsyncEngine's interface over an engine process, on the server's event loop.

Adds and aborts of one loop pass leave as one message; each step's outputs come back as one message, decoded once
and handed to every waiting handler's queue on the loop itself (no thread in between). The process's sentinel is
watched on the loop too, so a dead engine fails its requests at once, not on the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from core.sampling_params import SamplingParams
from frontend.engine.engine import RequestOutput
from frontend.engine.request_bounds import RequestBounds
from frontend.engine_errors import EngineDeadError, RequestFailedError, StepFailedError
from frontend.engine_proc.process import EngineProcess, exit_description
from frontend.engine_proc.spec import EngineSpec
from frontend.engine_proc.wire import Add, Codec, Dead, EngineStats, Failure, Inputs, Ready, RequestState, Step
from frontend.request_stream import RequestStreams

log = logging.getLogger("frontend")


class _Stream:
    __slots__ = ("state", "queue")

    def __init__(self, request_id: str, prompt: list[int]):
        self.state = RequestState(request_id, prompt)
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


def _failure_error(f: Failure) -> Exception:
    if f.kind == "refused":
        return ValueError(f.message)  # the engine's own checks: a 400, as in-process
    if f.kind == "step_failed":
        return StepFailedError(f.message)
    return RequestFailedError(f.message)


class EngineClient(RequestStreams):
    def __init__(self, spec: EngineSpec, process: EngineProcess):
        self.spec = spec
        self.codec = Codec()
        self.dead: EngineDeadError | None = None
        self.on_step: Callable[[], None] | None = None  # after each step's outputs are handed out (metrics)
        self.on_death: Callable[[EngineDeadError], None] | None = None  # on the loop, once per dead engine
        self.on_ready: Callable[[Ready], None] | None = None  # a restarted engine is ready
        self.active = 0  # generate() calls not yet returned
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # requests sent but not yet taken by the engine: they wait too
        self._pending_seqs = 0
        self._adds: list[Add] = []
        self._aborts: list[str] = []
        self._flush_at: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._use(process)

    def _use(self, process: EngineProcess) -> None:
        self._process = process
        ready = process.ready
        self.info = ready
        self.bounds = RequestBounds(ready.vocab_size, ready.max_model_len, ready.kv_tokens)
        self._stats = EngineStats(free_blocks=ready.num_blocks, total_blocks=ready.num_blocks)

    @property
    def pid(self) -> int:
        return self._process.pid

    # -- what handlers call -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.dead is None

    def stats(self) -> EngineStats:
        return self._stats

    def num_waiting(self) -> int:
        """Requests waiting (an n > 1 request counts once), those still on their way to the engine included."""
        return self._stats.waiting_requests + self._pending

    def num_waiting_seqs(self) -> int:
        return self._stats.waiting_seqs + self._pending_seqs

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request the engine would refuse; from the numbers it sent when it was ready."""
        self.bounds.check(prompt, params)

    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        if self.dead is not None:
            raise self.dead
        stream = self._streams[request_id] = _Stream(request_id, prompt)
        self._pending += 1
        self._pending_seqs += params.n
        self._adds.append(Add(request_id, params.n, self.codec.raw(prompt), self.codec.raw(params)))
        self._schedule_flush()
        return stream.queue

    def _abandon(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._aborts.append(request_id)
            self._schedule_flush()

    # -- the loop's side ----------------------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts receiving on `loop` (the server's, once it runs) and watching the process."""
        self._loop = loop
        process = self._process
        loop.add_reader(process.outputs.FD, self._receive, process)
        loop.add_reader(process.proc.sentinel, self._exited, process)
        loop.call_soon(self._receive, process)  # what came before the reader was added (ZMQ's FD is edge-triggered)

    def _schedule_flush(self) -> None:
        if self._flush_at is None and self._loop is not None:
            self._flush_at = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        if self.dead is not None or not (self._adds or self._aborts):
            return
        msg = Inputs(self._adds, self._aborts)
        self._adds, self._aborts = [], []
        try:
            self._process.inputs.send(self.codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the engine has not connected yet (cannot happen once it said ready): try again soon
            self._adds, self._aborts = msg.adds + self._adds, msg.aborts + self._aborts
            self._flush_at = self._loop.call_later(0.005, self._flush)

    def _receive(self, process: EngineProcess) -> None:
        """Everything the engine has sent: ZMQ's FD only says that something changed, so drain until nothing is
        left."""
        sock = process.outputs
        decode = self.codec.from_engine.decode
        while process is self._process and self.dead is None:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed: this engine is gone
                return
            try:
                msg = decode(raw)
            except msgspec.DecodeError:
                log.exception("engine client: a malformed message from the engine was dropped")
                continue
            if isinstance(msg, Step):
                self._apply(msg)
            elif isinstance(msg, Dead):
                self._died(process, msg.message)

    def _apply(self, step: Step) -> None:
        self._pending -= step.added_requests
        self._pending_seqs -= step.added_seqs
        self._stats = step.stats
        streams = self._streams
        for f in step.failures:
            stream = streams.pop(f.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(_failure_error(f))
        for delta in step.outputs:
            stream = streams.get(delta.request_id)
            if stream is None:  # aborted here while the step ran
                continue
            out = stream.state.apply(delta)
            stream.queue.put_nowait(out if delta.error is None else RequestFailedError(delta.error))
            if delta.finished:
                del streams[delta.request_id]
        if self.on_step is not None:
            try:
                self.on_step()
            except Exception:  # metrics must never stop the outputs
                log.exception("engine client: on_step failed")

    def _exited(self, process: EngineProcess) -> None:
        process.proc.join(0.5)  # the sentinel said it ended: reap it, for its exit code
        self._died(process, f"the engine process (pid {process.pid}) {exit_description(process.proc.exitcode)}")

    def _died(self, process: EngineProcess, reason: str) -> None:
        """Fails every request of a dead engine at once, then lets the server's policy (exit, restart) act."""
        if process is not self._process or self.dead is not None:
            return  # already handled (its Dead message, then its sentinel)
        err = self.dead = EngineDeadError(reason)
        log.critical("%s; failing its %d request(s)", reason, len(self._streams))
        self._release(process)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(err)
        self._pending = self._pending_seqs = 0
        self._adds, self._aborts = [], []
        if self.on_death is not None and not self._closing:
            self.on_death(err)

    def _release(self, process: EngineProcess) -> None:
        """Stops listening to `process` (its sockets stay open until it is stopped)."""
        if self._loop is not None:
            self._loop.remove_reader(process.outputs.FD)
            self._loop.remove_reader(process.proc.sentinel)

    async def restart(self) -> None:
        """A new engine process in place of the dead one; raises EngineStartError if it cannot load."""
        loop = asyncio.get_running_loop()
        old = self._process
        await loop.run_in_executor(None, old.stop, 5)
        start = time.monotonic()
        process = await loop.run_in_executor(None, EngineProcess.start, self.spec)
        self._use(process)
        self.attach(loop)
        self.dead = None
        log.warning("engine process restarted (pid %d) in %.1f s", process.pid, time.monotonic() - start)
        if self.on_ready is not None:
            self.on_ready(process.ready)

    def shutdown(self) -> None:
        """Stops the engine process (the server is done with it); what still waits fails."""
        self._closing = True
        err = self.dead = self.dead or EngineDeadError("the server is shutting down")
        try:
            self._release(self._process)
            for stream in self._streams.values():
                stream.queue.put_nowait(err)
        except RuntimeError:  # the loop is closed already: nobody waits any more
            pass
        self._streams.clear()
        self._process.stop(timeout=10)
