"""A stream that fell behind under load: its waiting reports join into one (frontend.engine.outputs.merge_outputs,
frontend.request_stream), and what the client reads adds up the same. SmolLM2 on MLX, real engine reports."""

from __future__ import annotations

import asyncio
import functools

from core.sampling_params import SamplingParams
from frontend import request_stream
from frontend.engine.outputs import merge_outputs
from frontend.request_stream import RequestStreams

PROMPT = [1, 504, 3575, 282, 4649, 314]


def reports(engine, params: SamplingParams) -> list:
    rid = engine.add_request(PROMPT, params)
    out = []
    while engine.has_unfinished():
        out += [r for r in engine.step() if r.request_id == rid]
    return out


def test_merged_reports_are_one_report_of_their_tokens(make_engine):
    """n = 2 with logprobs and a stop string: every run of successive reports merges into one whose deltas are the
    run's, and whose totals, logprobs and finish are the last report's."""
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2, stop=["zzz"])
    outs = reports(make_engine(), params)
    assert len(outs) >= 6 and outs[-1].finished
    for lo, hi in [(0, len(outs)), (1, 4), (2, 3), (len(outs) - 3, len(outs))]:
        merged = functools.reduce(merge_outputs, outs[lo:hi])
        last = outs[hi - 1]
        assert merged.finished == last.finished and merged.request_id == last.request_id
        for i in (0, 1):
            run = [c for r in outs[lo:hi] for c in r.outputs if c.index == i]
            c = next(c for c in merged.outputs if c.index == i)
            assert c.delta_token_ids == [t for r in run for t in r.delta_token_ids]
            assert c.delta_text == "".join(r.delta_text for r in run)
            assert c.token_ids == run[-1].token_ids and c.text == run[-1].text
            assert c.finish_reason == run[-1].finish_reason and c.logprobs is run[-1].logprobs
            start = c.num_tokens - len(c.delta_token_ids)  # what serving slices the new logprobs by
            assert c.token_ids[start:] == c.delta_token_ids
            assert c.text[c.text_len - len(c.delta_text):] == c.delta_text


class _Prefilled(RequestStreams):
    """A front-end whose requests' reports are all waiting already (a handler that fell behind all of them)."""

    def __init__(self, items: list, active: int):
        self.items, self.active, self.abandoned = items, active, []

    def _submit(self, request_id, prompt, params):
        q = asyncio.Queue()
        for item in self.items:
            q.put_nowait(item)
        return q

    def _abandon(self, request_id):
        self.abandoned.append(request_id)


def test_generate_joins_waiting_reports_only_under_load(make_engine):
    outs = reports(make_engine(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    async def read(active: int, items: list) -> list:
        return [o async for o in _Prefilled(items, active).generate(PROMPT, SamplingParams(max_tokens=8))]

    alone = asyncio.run(read(0, outs))
    assert [o.outputs[0].delta_token_ids for o in alone] == [o.outputs[0].delta_token_ids for o in outs]
    busy = asyncio.run(read(request_stream.COALESCE_STREAMS, outs))
    assert len(busy) == 1 and busy[0].finished
    assert busy[0].outputs[0].delta_token_ids == outs[-1].outputs[0].token_ids
    boom = RuntimeError("the step failed")
    got, err = [], None

    async def failing():
        front = _Prefilled(outs[:3] + [boom], request_stream.COALESCE_STREAMS)
        async for o in front.generate(PROMPT, SamplingParams()):
            got.append(o)

    try:
        asyncio.run(failing())
    except RuntimeError as e:
        err = e
    assert err is boom and len(got) == 1  # what came before the failure is handed out first, joined
    assert got[0].outputs[0].delta_token_ids == [t for o in outs[:3] for t in o.outputs[0].delta_token_ids]
