"""A burst of requests reaching an idle engine process is prefilled in one step (frontend/engine_proc/arrivals.py):
the first arrival is not prefilled alone, so its second token does not wait for the rest of the burst's prefill.
The engine loop (EngineCore, with a real engine on SmolLM2) is fed through an inbox on a virtual clock, so what
arrives when is exact and the test asserts which step carries what, not how long anything took."""

from __future__ import annotations

import os

import pytest
import zmq

from core.sampling_params import SamplingParams
from frontend.engine_proc import arrivals, step_log
from frontend.engine_proc.arrivals import ArrivalGather
from frontend.engine_proc.core import EngineCore
from frontend.engine_proc.wire import Add, Codec, Inputs, Step

MS = 1e-3
STEP_S = 20 * MS


class VirtualInbox:
    """The engine's inbox socket (poll in ms, recv with NOBLOCK) over a script of (time, message) on a virtual clock
    that moves while the engine polls and by STEP_S with each step it reports (Outbox)."""

    def __init__(self, script: list[tuple[float, bytes]]):
        self.script = sorted(script, key=lambda m: m[0])
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def poll(self, timeout_ms: float) -> int:
        if self.script and self.script[0][0] <= self.now + timeout_ms * MS:
            self.now = max(self.now, self.script[0][0])
            return zmq.POLLIN
        self.now += timeout_ms * MS
        return 0

    def recv(self, flags: int = 0) -> bytes:
        if self.script and self.script[0][0] <= self.now:
            return self.script.pop(0)[1]
        raise zmq.Again()


class Outbox:
    def __init__(self, codec: Codec, inbox: VirtualInbox):
        self.codec, self.inbox, self.steps = codec, inbox, []

    def send(self, raw: bytes, flags: int = 0) -> None:
        msg = self.codec.from_engine.decode(raw)
        assert isinstance(msg, Step)
        self.steps.append(msg)
        self.inbox.now += STEP_S


def _adds(codec: Codec, ids: list[str], max_tokens: int) -> bytes:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return codec.encode(Inputs(adds=[Add(rid, 1, codec.raw([1 + i, 2 + i, 3 + i, 4 + i, 5 + i]), codec.raw(params))
                                     for i, rid in enumerate(ids)]))


def _run(engine, script: list[tuple[float, list[str]]], max_tokens: int = 3) -> list[dict[str, int]]:
    """Runs the engine loop over the script (then a stop); per step with outputs: request -> its tokens so far."""
    codec = Codec()
    inbox = VirtualInbox([(t, _adds(codec, ids, max_tokens)) for t, ids in script]
                         + [(3600.0, codec.encode(Inputs(stop=True)))])
    outbox = Outbox(codec, inbox)
    EngineCore(engine, inbox, outbox, codec, os.getppid(), clock=inbox.clock).run()
    seen: dict[str, int] = {}
    steps = []
    for step in outbox.steps:
        for d in step.outputs:
            seen[d.request_id] = seen.get(d.request_id, 0) + len(d.outputs[0].token_ids)
        if step.outputs:
            steps.append({d.request_id: seen[d.request_id] for d in step.outputs})
    return steps


BURST = [(0.0, ["a"]), (0.5 * MS, ["b", "c"]), (1.5 * MS, ["d"]), (2.0 * MS, ["e", "f", "g", "h"])]


def test_a_burst_at_an_idle_engine_is_prefilled_in_one_step(make_engine, monkeypatch, tmp_path):
    monkeypatch.delenv(arrivals.ENV, raising=False)
    monkeypatch.setenv(step_log.ENV, str(tmp_path / "steps.jsonl"))
    steps = _run(make_engine(max_num_seqs=8), BURST)
    ids = "abcdefgh"
    # The first step prefills all eight (each gets its first token), the very next one gives each its second:
    # before, "a" was prefilled alone and its second token came with the prefill of the seven others.
    assert steps[0] == dict.fromkeys(ids, 1)
    assert steps[1] == dict.fromkeys(ids, 2)
    assert steps[2] == dict.fromkeys(ids, 3)
    got = step_log.summarize(str(tmp_path / "steps.jsonl"))
    assert (got["steps"], got["steps_with_prompt_tokens"], got["new_streams"]) == (3, 1, 8)
    assert got["first_gaps_with_prompt_tokens"] == 0


def test_without_gathering_the_first_arrival_is_prefilled_alone(make_engine, monkeypatch, tmp_path):
    monkeypatch.setenv(arrivals.ENV, "0")
    monkeypatch.setenv(step_log.ENV, str(tmp_path / "steps.jsonl"))
    steps = _run(make_engine(max_num_seqs=8), BURST)
    assert steps[0] == {"a": 1}  # what the gathering is for: "a"'s second token waits for seven prefills
    assert steps[1] == {"a": 2, **dict.fromkeys("bcdefgh", 1)}
    got = step_log.summarize(str(tmp_path / "steps.jsonl"))
    assert (got["steps_with_prompt_tokens"], got["new_streams"], got["first_gaps_with_prompt_tokens"]) == (2, 8, 1)
    assert got["first_gap_prompt_tokens_p50"] == 0  # seven of the eight first gaps carried no prompt


def test_arrivals_after_a_silence_or_into_a_busy_engine_are_not_waited_for(make_engine, monkeypatch):
    monkeypatch.delenv(arrivals.ENV, raising=False)
    # "b" comes 30 ms after "a": past the quiet window (5 ms before a first step), so "a" starts alone; "b" then
    # reaches a busy engine (during its second step) and is taken into the next step without waiting.
    steps = _run(make_engine(max_num_seqs=8), [(0.0, ["a"]), (30 * MS, ["b"])])
    assert steps[:3] == [{"a": 1}, {"a": 2}, {"a": 3, "b": 1}]


class Script:
    """poll/take over arrival times on a virtual clock, for ArrivalGather alone."""

    def __init__(self, times: list[float]):
        self.times, self.now, self.taken = sorted(times), 0.0, 0

    def poll(self, s: float) -> bool:
        if self.times and self.times[0] <= self.now + s:
            self.now = max(self.now, self.times[0])
            return True
        self.now += s
        return False

    def take(self) -> bool:
        while self.times and self.times[0] <= self.now:
            self.times.pop(0)
            self.taken += 1
        return False


@pytest.mark.parametrize("times, taken, waited", [
    ([1, 2, 3, 3.5], 4, 3.5 + 2.5),  # a burst: each within the quiet window of the last, then one quiet window
    ([1, 2, 8], 2, 2 + 2.5),  # a silence longer than the window ends the burst
    ([0.5 * k for k in range(1, 40)], 20, 10),  # a steady trickle: the wait ends at one step's time
])
def test_gather_windows(times, taken, waited):
    g = ArrivalGather.for_step(10 * MS)  # a quarter of a 10 ms step: 2.5 ms of quiet, 10 ms at most
    assert (g.quiet_s, g.max_s) == (2.5 * MS, 10 * MS)
    s = Script([t * MS for t in times])
    g.gather(s.poll, s.take, lambda: False, lambda: s.now)
    assert s.taken == taken
    assert s.now == pytest.approx(waited * MS)


def test_gather_stops_once_a_step_is_full():
    s = Script([k * MS for k in range(1, 10)])
    ArrivalGather.for_step(10 * MS).gather(s.poll, s.take, lambda: s.taken >= 3, lambda: s.now)
    assert s.taken == 3


def test_gather_windows_are_bounded():
    assert ArrivalGather.for_step(None) == ArrivalGather(5 * MS, 20 * MS)  # before the first step
    assert ArrivalGather.for_step(2.0) == ArrivalGather(10 * MS, 50 * MS)  # a slow CPU step
    assert ArrivalGather.for_step(0.0001) == ArrivalGather(1 * MS, 2 * MS)
