"""Failures that must stay with the request that caused them: a row the sampler cannot serve, a refused prompt in
LLM.generate. SmolLM2 on the MLX backend, as in test_engine."""

from __future__ import annotations

import numpy as np
import pytest

from core.sampling_params import SamplingParams
from tests.test_engine import chat, run


def unservable() -> SamplingParams:
    """Parameters that passed validation and then went bad (NaN): its row's draw raises in the sampler."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    params.temperature = float("nan")
    return params


def test_a_row_the_sampler_cannot_serve_fails_its_request_alone(smollm, make_engine):
    tok = smollm.tokenizer
    innocent = [chat(tok, "Name a colour."), chat(tok, "Count to five.")]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)]
    engine = make_engine()
    alone = run(engine, innocent, params)
    together = run(engine, [innocent[0], chat(tok, "Say hi."), innocent[1]],
                   [params[0], unservable(), params[1]])
    bad = together[1]
    assert bad.finished and bad.error and "sampling failed" in bad.error
    assert all(c.finish_reason == "abort" and -1 not in c.token_ids for c in bad.outputs)
    for a, b in zip(alone, (together[0], together[2]), strict=True):
        assert b.error is None and b.outputs[0].token_ids == a.outputs[0].token_ids


def test_n_siblings_fail_together(smollm, make_engine):
    engine = make_engine()
    params = unservable()
    params.n = 3
    out = run(engine, [chat(smollm.tokenizer, "Say hi.")], [params])[0]
    assert out.error and [c.finish_reason for c in out.outputs] == ["abort"] * 3


def test_generate_aborts_what_it_added_when_a_later_prompt_is_refused(mlx_smollm):
    from frontend.engine.engine import EngineConfig
    from frontend.engine.llm import LLM

    llm = LLM.from_backend(mlx_smollm, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2, 3], [4, 5], []], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished() and llm.engine.num_waiting() == 0 and llm.engine.all_blocks_free()

    class Interrupt(BaseException):
        pass

    step, calls = llm.engine.step, []

    def interrupted_step():  # the loop raising after a few steps: a KeyboardInterrupt in a notebook
        calls.append(1)
        if len(calls) == 3:
            raise Interrupt
        return step()

    llm.engine.step = interrupted_step
    with pytest.raises(Interrupt):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=30, ignore_eos=True))
    llm.engine.step = step
    assert not llm.engine.has_unfinished() and llm.engine.all_blocks_free()
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids


def test_min_tokens_mask_leaves_logprobs_to_the_model(smollm, make_engine):
    engine = make_engine()
    ids = chat(smollm.tokenizer, "What is the capital of France?")
    plain = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=2, logprobs=3)])[0].outputs[0]
    first = plain.token_ids[0]
    banned = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=2, logprobs=3, min_tokens=2,
                                                stop_token_ids=[first])])[0].outputs[0]
    assert banned.token_ids[0] != first  # the mask did apply to the draw: the runner-up was taken
    assert banned.token_ids[0] == plain.logprobs[0].top[1][0]
    # ...but the logprobs are the model's: the banned token still tops the list, with its own logprob
    # (to fp32 rounding: the second prompt hits the prefix cache, so its last token runs in another shape)
    got, want = banned.logprobs[0].top, plain.logprobs[0].top
    assert [t for t, _ in got] == [t for t, _ in want] and got[0][0] == first
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], atol=1e-4)
    assert banned.logprobs[0].logprob == pytest.approx(want[1][1], abs=1e-4)
