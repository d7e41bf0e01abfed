"""The engine process: it loads the model, owns the backend and the scheduler, and runs the step loop, fed by the
API process's `Inputs` and answering each step with one `Step` (wire.py).

Detokenization and stop strings stay here, in the engine's own detokenizer: a stop string ends its sequence in the
step that completes it (blocks freed, no token generated past it), as the offline engine does. Matching stop strings
in the API process instead (as vLLM does) would keep a stopped sequence decoding until the abort arrives, and an n > 1
sibling would need an abort of its own; the cost that saves is small here (docs/ARCHITECTURE.md gives the figure).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

from frontend.engine.engine import LLMEngine
from frontend.engine_errors import EngineDeadError
from frontend.engine_proc import arrivals
from frontend.engine_proc.spec import LOAD_ERRORS, EngineSpec
from frontend.engine_proc.step_log import StepLog
from frontend.engine_proc.wire import Codec, Dead, Failure, LoadFailed, Ready, Step, delta_of, stats_of

log = logging.getLogger("frontend.engine")
_IDLE_POLL_MS = 1000  # how often an idle engine looks whether the API process is still there
_STUCK_STEP_S = 0.3  # how long a step may go on after a worker died before the process ends itself (worker_died)


def main(spec: EngineSpec, inputs_addr: str, outputs_addr: str, parent_pid: int) -> None:
    """The engine process's entry point (a multiprocessing spawn target)."""
    # Ctrl-C in a terminal reaches the whole process group: the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from frontend.cli import setup_logging

    setup_logging(spec.log_file)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inputs_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    outbox.connect(outputs_addr)
    try:
        code = _serve(spec, inbox, outbox, parent_pid, lambda reason: _die_now(outputs_addr, reason))
    finally:
        inbox.close(linger=0)
        outbox.close(linger=2000)  # the last message (LoadFailed, Dead) must leave before the process does
        ctx.term()
    if code == 1:  # died: a backend thread in a bad state must not keep the process alive
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _die_now(outputs_addr: str, reason: str) -> None:
    """Tells the API process why, on a socket of its own (another thread may hold the outbox), and ends the process
    whatever its other threads are doing."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(outputs_addr)
    sock.send(Codec().encode(Dead(f"the engine process died: {reason}")))
    sock.close(linger=2000)
    ctx.term()  # returns once the message has left (or after the linger)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _serve(spec: EngineSpec, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int,
           die_now: Callable[[str], None]) -> int:
    """Loads, says ready, runs the loop; the exit code: 0 stopped, 1 died, 2 could not load."""
    codec = Codec()
    try:
        engine = spec.load()
    except LOAD_ERRORS as e:
        outbox.send(codec.encode(LoadFailed(str(e))))
        return 2
    except Exception as e:  # noqa: BLE001 - the API process must get a line, not wait for one
        log.critical("loading the model failed", exc_info=True)
        outbox.send(codec.encode(LoadFailed(f"loading the model failed: {e.__class__.__name__}: {e}")))
        return 2
    blocks = engine.blocks
    outbox.send(codec.encode(Ready(os.getpid(), engine.backend.model.config.vocab_size, engine.max_model_len,
                                   blocks.num_blocks, blocks.block_size, blocks.token_capacity,
                                   engine.backend.model.pooling)))
    try:
        core = EngineCore(engine, inbox, outbox, codec, parent_pid)
        engine.backend.on_worker_death(lambda error: core.worker_died(error, die_now))
        core.run()
    except BaseException as e:  # noqa: BLE001 - whatever ends the loop, the API process hears why at once
        log.critical("the engine process died", exc_info=True)
        reason = str(e) if isinstance(e, EngineDeadError) else f"{e.__class__.__name__}: {e}"
        outbox.send(codec.encode(Dead(f"the engine process died: {reason}")))
        return 1
    return 0


class EngineCore:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, codec: Codec, parent_pid: int,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.inbox, self.outbox, self.codec = inbox, outbox, codec
        self.parent_pid = parent_pid
        self.clock = clock
        self.gather_arrivals = arrivals.enabled()
        self.last_step_s: float | None = None  # the last step's wall time: how long a burst may be waited for
        self.step_log = StepLog.from_env()
        self.in_step = False

    def run(self) -> None:
        """Returns on a stop message or when the API process is gone."""
        try:
            self._loop()
        finally:
            if self.step_log is not None:
                self.step_log.close()

    def _loop(self) -> None:
        engine = self.engine
        check_s = engine.backend.idle_check_s()  # None: nothing to watch between steps (one process)
        idle_poll_ms = _IDLE_POLL_MS if check_s is None else int(check_s * 1000)
        while True:
            if os.getppid() != self.parent_pid:
                log.warning("the API process is gone; the engine stops")
                return
            idle = not engine.has_unfinished()
            if idle and not self.inbox.poll(idle_poll_ms):
                if check_s is not None:
                    self._check_alive()
                continue
            failures: list[Failure] = []
            took, added, seqs, stop = self._take_inputs(failures)
            if idle and added and self.gather_arrivals and not stop:  # the rest of a burst joins its first step
                more, more_seqs, stop = self._gather(failures)
                added, seqs = added + more, seqs + more_seqs
            if stop:
                return
            outputs = []
            stepped = engine.has_unfinished()
            if stepped:
                outputs = self._step(failures, added)
            if took or stepped:
                self._send(Step(outputs, failures, stats_of(engine), added, seqs))

    def _gather(self, failures: list[Failure]) -> tuple[int, int, bool]:
        """An idle engine's first arrivals: takes the rest of their burst (arrivals.py); (requests, sequences added,
        stop)."""
        added = seqs = 0
        stop = False

        def take() -> bool:
            nonlocal added, seqs, stop
            _, more, more_seqs, stop = self._take_inputs(failures)
            added, seqs = added + more, seqs + more_seqs
            return stop

        sched = self.engine.scheduler
        cfg = sched.config

        def full() -> bool:  # a step's worth waits: more would only wait for the next step anyway
            return (len(sched.waiting) >= cfg.max_num_seqs
                    or sum(s.num_tokens for s in sched.waiting) >= cfg.max_num_batched_tokens)

        gather = arrivals.ArrivalGather.for_step(self.last_step_s)
        gather.gather(lambda s: bool(self.inbox.poll(max(1, math.ceil(s * 1e3)))), take, full, self.clock)
        return added, seqs, stop

    def worker_died(self, error: BaseException, die_now: Callable[[str], None]) -> None:
        """From the backend's watch thread, when a tensor-parallel worker exits. The loop notices by itself (a failed
        step, the idle check), except in a step waiting on a collective that its transport cannot fail: MLX's ring
        can wait for a dead peer for ever. A step still running after _STUCK_STEP_S ends the process (die_now)."""
        deadline = self.clock() + _STUCK_STEP_S
        while self.clock() < deadline:
            if not self.in_step:
                return  # idle, or the step failed: the loop's own path says why
            time.sleep(0.02)
        if self.in_step:
            log.critical("%s during a step that cannot end; the engine process ends", error)
            die_now(f"{error} during a step")

    def _check_alive(self) -> None:
        """An idle engine whose backend lost a worker dies now, as a failed step would, not at the next request."""
        try:
            self.engine.backend.check_alive()
        except Exception as e:
            raise EngineDeadError(f"{e} while the engine was idle") from e

    def _take_inputs(self, failures: list[Failure]) -> tuple[bool, int, int, bool]:
        """Every message waiting, adds before aborts (an abort may name an add of the same message)."""
        took, added, seqs = False, 0, 0
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return took, added, seqs, False
            took = True
            try:
                msg = self.codec.inputs.decode(raw)
            except msgspec.DecodeError:
                log.exception("engine: a malformed message from the API process was dropped")
                continue
            if msg.stop:
                return took, added, seqs, True
            for add in msg.adds:
                added += 1
                seqs += add.n
                self._add(add, failures)
            for rid in msg.aborts:
                if rid in self.engine.requests:
                    log.info("request %s aborted: its client went away", rid)
                self.engine.abort_request(rid)

    def _add(self, add, failures: list[Failure]) -> None:
        try:
            prompt = self.codec.prompt.decode(add.prompt)
            params = self.codec.params.decode(add.params)
        except (msgspec.DecodeError, ValueError) as e:  # ValidationError is both
            log.warning("engine: request %s could not be decoded: %s", add.request_id, e)
            failures.append(Failure(add.request_id, "failed", f"the engine could not add the request: {e}"))
            return
        try:
            self.engine.add_request(prompt, params, add.request_id)
        except ValueError as e:  # refused (the API process's checks ran against an older state)
            failures.append(Failure(add.request_id, "refused", str(e)))
        except Exception as e:  # one malformed request fails alone
            log.exception("engine: adding request %s failed", add.request_id)
            self.engine.abort_request(add.request_id)
            failures.append(Failure(add.request_id, "failed", f"the engine could not add the request: {e}"))

    def _step(self, failures: list[Failure], added: int) -> list:
        engine = self.engine
        start = self.clock()
        self.in_step = True
        try:
            outputs = engine.step()
            self.last_step_s = self.clock() - start
            if self.step_log is not None:
                self.step_log.write(start, start + self.last_step_s, engine, outputs, added)
            return [delta_of(out) for out in outputs]
        except Exception as e:  # a backend failure fails this step's requests; the engine goes on
            if engine.backend.is_fatal(e):  # e.g. a poisoned CUDA context: no later step can run
                raise EngineDeadError(f"the backend cannot run another step after {e.__class__.__name__}: "
                                      f"{e}") from e
            log.exception("engine step failed; aborting the %d running request(s)", len(engine.requests))
            message = f"the engine step failed: {e.__class__.__name__}: {e}"
            for rid in list(engine.requests):
                failures.append(Failure(rid, "step_failed", message))
                try:
                    engine.abort_request(rid)
                except Exception:
                    log.exception("engine: aborting %s failed", rid)
            return []
        finally:
            self.in_step = False

    def _send(self, msg: Step) -> None:
        try:
            self.outbox.send(self.codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # no API process connected any more: run() sees it gone
            log.warning("engine: a step's outputs had no reader")
