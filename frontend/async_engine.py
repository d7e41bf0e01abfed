"""The engine in the server's own process (--engine-in-process, and tests): a thread that runs the step loop, fed
by a queue, and hands each request's outputs to the asyncio handler that waits for them. Sanic handlers never touch
the engine itself. By default the engine runs in a process of its own instead (frontend/engine_proc/), with the same
interface, so that the step loop and the HTTP server do not share one GIL."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from dataclasses import dataclass

from core.sampling_params import SamplingParams
from frontend.engine.engine import LLMEngine, RequestOutput
from frontend.engine_errors import EngineDeadError, RequestFailedError, StepFailedError
from frontend.engine_proc.wire import EngineStats, Ready, stats_of
from frontend.request_stream import RequestStreams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError", "StepFailedError"]
log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class _Stream:
    """Outputs of one request, crossing from the engine thread into the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


class AsyncEngine(RequestStreams):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # requests handed over but not yet in the engine: they wait too
        self._pending_seqs = 0
        self._lock = threading.Lock()
        self.dead: EngineDeadError | None = None  # set (under the lock) once the engine thread has ended
        self._taken: list = []  # the messages the engine thread took from the inbox last
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.on_step = None  # called in the engine thread after each step (metrics)
        self.on_death = None  # called on the attached loop when the thread dies (not on shutdown)
        self.active = 0  # generate() calls not yet returned
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        blocks = engine.blocks
        self.info = Ready(os.getpid(), engine.backend.model.config.vocab_size, engine.max_model_len,
                          blocks.num_blocks, blocks.block_size, blocks.token_capacity, engine.backend.model.pooling)
        self.bounds = engine.bounds
        self._thread.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop on_death is called on (the server's)."""
        self._event_loop = loop

    # -- called from handlers -----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return stats_of(self.engine)

    def num_waiting(self) -> int:
        """Requests waiting (an n > 1 request counts once)."""
        # tuple() copies the deque in one C call, which the engine thread cannot interleave with (the GIL)
        waiting = tuple(self.engine.scheduler.waiting)
        return len({s.request_id for s in waiting}) + self._pending

    def num_waiting_seqs(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_seqs

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request the engine would refuse (context, KV capacity, token ids)."""
        self.engine.check_request(prompt, params)

    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # against _die: either it sees this add in the inbox, or this sees it dead
            if self.dead is not None:
                raise self.dead
            self._pending += 1
            self._pending_seqs += params.n
            self._inbox.put(_Add(request_id, prompt, params, stream))
        return stream.queue

    def _abandon(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(_Stop())
        self._thread.join(timeout=10)

    # -- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever ends the thread, no handler may wait forever
            log.critical("the engine thread died", exc_info=True)
            self._die(EngineDeadError(f"the engine thread died: {e.__class__.__name__}: {e}"))
        else:
            self._die(EngineDeadError("the server is shutting down"))

    def _die(self, err: EngineDeadError) -> None:
        with self._lock:
            self.dead = err
            left = list(self._taken)  # taken from the inbox, maybe not handled: a second error is harmless
            while True:
                try:
                    left.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in left:
                if isinstance(msg, _Add):
                    msg.stream.put(err)
        self._fail_all(err)
        if self.on_death is not None and self._event_loop is not None and not self._stopping:
            try:
                self._event_loop.call_soon_threadsafe(self.on_death, err)
            except RuntimeError:  # the loop is closed: the server is gone already
                pass

    def _loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            try:
                msgs = [self._inbox.get(block=not busy, timeout=None)]
            except queue.Empty:
                msgs = []
            while True:
                try:
                    msgs.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._taken = msgs
            for msg in msgs:
                if isinstance(msg, _Stop):
                    return
                try:
                    self._handle(msg)
                except Exception as e:  # one malformed message fails its own request, not the thread
                    log.exception("engine: handling %s failed", type(msg).__name__)
                    if isinstance(msg, _Add):
                        self._streams.pop(msg.request_id, None)
                        msg.stream.put(RequestFailedError(f"the engine could not add the request: {e}"))
            adds = [m for m in msgs if isinstance(m, _Add)]
            if adds:
                with self._lock:  # now counted in the engine's own queue (or refused)
                    self._pending -= len(adds)
                    self._pending_seqs -= sum(m.params.n for m in adds)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a backend failure must not leave handlers waiting forever
                if self.engine.backend.is_fatal(e):  # e.g. a poisoned CUDA context: no later step can run
                    raise EngineDeadError(f"the backend cannot run another step after {e.__class__.__name__}: "
                                          f"{e}") from e
                log.exception("engine step failed; aborting the %d running request(s)", len(self._streams))
                self._fail_all(StepFailedError(f"the engine step failed: {e.__class__.__name__}: {e}"))
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out if out.error is None else RequestFailedError(out.error))
                    if out.finished:
                        del self._streams[out.request_id]
            if self.on_step is not None:
                try:
                    self.on_step()
                except Exception:  # metrics must never stop the engine
                    log.exception("engine: on_step failed")

    def _handle(self, msg: _Add | _Abort) -> None:
        if isinstance(msg, _Abort):
            if self._streams.pop(msg.request_id, None) is not None:
                log.info("request %s aborted: its client went away", msg.request_id)
            self.engine.abort_request(msg.request_id)
            return
        try:
            self.engine.add_request(msg.prompt, msg.params, msg.request_id)
        except ValueError as e:  # refused (the handler's checks ran against an older state)
            msg.stream.put(e)
            return
        self._streams[msg.request_id] = msg.stream

    def _fail_all(self, err: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put(err)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("engine: aborting %s failed", rid)
        self._streams.clear()
