"""One-shot flags when serving, the engine seed, and vLLM's import line."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams
from frontend.cli import parse_args
from tests.test_engine import chat, run


def test_vllm_style_import():
    from frontend import LLM
    from frontend import SamplingParams as Params
    from frontend.engine.llm import LLM as EngineLLM

    assert LLM is EngineLLM and Params is SamplingParams


@pytest.mark.parametrize("flags, words", [(["--system", "be brief"], "--system applies to --prompt"),
                                          (["--max-tokens", "9"], "--max-gen-tokens")])
def test_one_shot_flags_are_refused_when_serving(flags, words, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert words in capsys.readouterr().err
    args = parse_args([*flags, "--prompt", "hi"])  # with --prompt they mean what they say
    assert args.system == "be brief" or args.max_tokens == 9


def test_limit_flags_reach_the_limits():
    from frontend.limits import ServingLimits

    limits = ServingLimits.from_args(parse_args(["--max-stop", "2", "--max-request-bytes", "1000"]))
    assert limits.max_stop == 2 and limits.max_request_bytes == 1000 and limits.max_n == ServingLimits().max_n
    with pytest.raises(SystemExit):
        parse_args(["--max-n", "0"])


def test_decode_step_budget_flags_reach_the_scheduler():
    """Unset: None, which the engine fills in with the backend's knee; 0: off; the spread as given."""
    from frontend.cli import engine_config

    default = engine_config(parse_args([])).scheduler
    assert default.decode_step_tokens is None and default.prefill_spread_steps == 16
    sched = engine_config(parse_args(["--decode-step-tokens", "0", "--prefill-spread-steps", "4"])).scheduler
    assert sched.decode_step_tokens == 0 and sched.prefill_spread_steps == 4


def test_engine_seed_makes_unseeded_requests_reproducible(smollm, make_engine):
    prompts = [chat(smollm.tokenizer, f"Tell me about {t}.") for t in ("rain", "cats", "bread")]
    assert parse_args(["--seed", "5"]).seed == 5
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)] * 3
    runs = [[o.outputs[0].token_ids for o in run(make_engine(seed=seed), prompts[:3], params)]
            for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
    assert len({tuple(t) for t in runs[0]}) == 3
