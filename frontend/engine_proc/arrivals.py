"""A burst of requests reaching an idle engine is prefilled in one step, not the first of them alone.

Clients that start together (a closed loop's wave, a batch job's fan-out) reach the engine a few milliseconds apart.
An idle engine that stepped on the first arrival at once prefilled it alone and the rest of the burst in the next
step, so that request's second token waited for everyone else's prefill: on this CPU (SmolLM2, 8-16 streams) a
first gap of 1.3-7.9 s against a 130-170 ms decode step. In a closed loop the request that went first also finishes
a step early, comes back alone and goes first again, wave after wave (docs/BENCHMARKS.md, 2026-12-04). Nothing
decodes while the engine is idle, so waiting costs no stream a gap: the engine keeps taking requests while they come
within a quarter of a step of each other, for at most one step, and starts as soon as a step's worth of prompts waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

ENV = "LLM_ENGINE_GATHER_ARRIVALS"  # "0": an idle engine steps on the first arrival at once (the rule before)
QUIET_SHARE = 0.25  # of the last step's time: the longest silence that still counts as one burst
QUIET_BOUNDS_S = (0.001, 0.010)
MAX_BOUNDS_S = (0.002, 0.050)  # the whole wait: one step's time, within these
FIRST_STEP_S = 0.020  # the step time assumed before the engine has run one


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(bounds[1], max(bounds[0], value))


@dataclass(frozen=True)
class ArrivalGather:
    quiet_s: float  # a burst ends when no request has come for this long
    max_s: float  # and the wait ends after this long in any case

    @classmethod
    def for_step(cls, step_s: float | None) -> ArrivalGather:
        """The windows for an engine whose last step took `step_s` seconds (None: it has run none yet)."""
        step_s = FIRST_STEP_S if step_s is None else step_s
        return cls(_clamp(QUIET_SHARE * step_s, QUIET_BOUNDS_S), _clamp(step_s, MAX_BOUNDS_S))

    def gather(self, poll: Callable[[float], bool], take: Callable[[], bool], full: Callable[[], bool],
               clock: Callable[[], float] = time.monotonic) -> None:
        """Takes what keeps arriving: `poll(s)` waits up to s seconds for a message, `take()` takes every waiting one
        (True: stop gathering, e.g. a stop message), `full()` says a step's worth of prompts already waits."""
        end = clock() + self.max_s
        while not full():
            left = end - clock()
            if left <= 0 or not poll(min(self.quiet_s, left)):
                return
            if take():
                return
