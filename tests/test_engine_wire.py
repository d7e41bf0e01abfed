"""The messages between the API process and the engine process: each step's outputs, sent as deltas through msgpack
and added up again on the API side, are the engine's own reports (text, ids, stop reasons, logprobs, n > 1)."""

from __future__ import annotations

from core.sampling_params import SamplingParams
from frontend.engine_proc.wire import Codec, EngineStats, Inputs, RequestState, Step, delta_of, stats_of
from tests.test_engine import chat


def test_deltas_add_up_to_the_engines_reports(smollm, make_engine):
    engine, codec = make_engine(), Codec()
    tok = smollm.tokenizer
    requests = [(chat(tok, "What is the capital of France?"), SamplingParams(temperature=0, max_tokens=24,
                                                                             stop=["Paris"], logprobs=2)),
                (chat(tok, "Say a word."), SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12)),
                (chat(tok, "Count to five."), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                             stop_token_ids=[28], include_stop_str_in_output=True))]
    states = {engine.add_request(p, sp): RequestState("", p) for p, sp in requests}
    # the add itself crosses too: parameters decode to what was sent
    add = codec.inputs.decode(codec.encode(Inputs([], ["x"])))
    assert add.aborts == ["x"] and codec.params.decode(codec.raw(requests[0][1])) == requests[0][1]
    final, rebuilt = {}, {}
    while engine.has_unfinished():
        outs = engine.step()
        msg = codec.from_engine.decode(codec.encode(Step([delta_of(o) for o in outs], [], stats_of(engine), 0, 0)))
        assert isinstance(msg, Step) and isinstance(msg.stats, EngineStats)
        for out, delta in zip(outs, msg.outputs, strict=True):
            got = states[delta.request_id].apply(delta)
            assert [c.delta_text for c in got.outputs] == [c.delta_text for c in out.outputs]
            if out.finished:
                final[out.request_id], rebuilt[out.request_id] = out, got
    assert final.keys() == states.keys()
    for rid, want in final.items():
        got = rebuilt[rid]
        assert got.finished and got.error is None and got.num_cached_tokens == want.num_cached_tokens
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert (g.index, g.text, g.token_ids, g.finish_reason, g.stop_reason) == (
                w.index, w.text, w.token_ids, w.finish_reason, w.stop_reason)
            assert (g.logprobs is None) == (w.logprobs is None)
            if w.logprobs is not None:
                assert [(e.token, e.logprob, [tuple(t) for t in e.top]) for e in g.logprobs] == [
                    (e.token, e.logprob, [tuple(t) for t in e.top]) for e in w.logprobs]
    first = rebuilt[next(iter(states))].outputs[0]  # the request with a stop string and logprobs
    assert first.stop_reason == "Paris" and first.logprobs
