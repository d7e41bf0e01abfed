"""The decode-step budget (scheduler.py's cost model): while streams decode, a step that prefills holds about the
tokens of a decode-only step, new prompts are spread over the steps that follow, and every prompt still enters
within a bounded number of steps. Driven step by step as the engine would, with arrivals between steps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.sampling_params import SamplingParams
from frontend.engine.block_manager import BlockManager
from frontend.engine.scheduler import Scheduler, SchedulerConfig
from frontend.engine.sequence import Sequence

FLOOR, RATIO, SPREAD = 16, 1.5, 4


def _seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(rid, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    np.random.default_rng(0))


def _drive(cfg: SchedulerConfig, arrivals: dict[int, list[tuple[int, int]]], steps: int):
    """Runs `steps` steps; arrivals[k]: (prompt length, max tokens) added before step k. Returns per step the
    tokens it computed and the streams decoding when it was scheduled, and per sequence the steps that gave it a
    token."""
    sched = Scheduler(cfg, BlockManager(4096, 16, prefix_caching=False))
    sizes, streams, tokens_at = [], [], {}
    for k in range(steps):
        for i, (plen, out) in enumerate(arrivals.get(k, ())):
            sched.add(_seq(f"{k}.{i}", plen, out))
        decoding = sum(1 for q in sched.running if q.output_token_ids and q.num_tokens - q.num_computed_tokens == 1)
        step = sched.schedule()
        sizes.append(sum(s.num_new for s in step))
        streams.append(decoding)
        for s in step:
            samples = s.samples
            s.seq.num_computed_tokens += s.num_new
            if samples:
                s.seq.output_token_ids.append(7)
                tokens_at.setdefault(s.seq.request_id, []).append(k)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    sched.finish(s.seq, "length")
    assert sched.num_preemptions == 0
    return sizes, streams, tokens_at


def _config(floor: int | None = FLOOR) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, prefill_chunk_size=512,
                           decode_step_tokens=floor, decode_step_ratio=RATIO, prefill_spread_steps=SPREAD)


def test_a_steady_stream_of_arrivals_keeps_every_step_near_a_decode_step():
    """Eight streams decode while a 40-token prompt arrives every third step: no step computes more than
    max(floor, 1.5 x streams) plus a spread share of one prompt, every stream gets a token every step, and each
    prompt's first token comes within a few steps of its arrival."""
    arrivals = {0: [(24, 60)] * 8, **{k: [(40, 30)] for k in range(6, 60, 3)}}
    sizes, streams, tokens_at = _drive(_config(), arrivals, 90)
    # the largest share the spread term can add: the prompt tokens that one arrival interval leaves, over SPREAD
    spread_share = math.ceil(2 * 40 / SPREAD)
    for k in range(6, 90):
        if streams[k]:
            assert sizes[k] <= max(FLOOR, math.ceil(RATIO * streams[k]), streams[k] + spread_share), k
    for rid, steps in tokens_at.items():
        assert np.all(np.diff(steps) == 1), rid  # a decoding stream is never left out of a step
    for k in range(6, 60, 3):
        assert tokens_at[f"{k}.0"][0] - k <= 2 * SPREAD, k  # entered within a few steps


def test_a_burst_is_spread_over_steps_and_every_prompt_enters():
    """Thirty 64-token prompts arrive at once while four streams decode: the budget off lands 512 tokens in one
    step; on, the burst is spread (no step above the streams plus a SPREAD-th of what is left) and the last prompt
    still starts within about SPREAD x ln(burst) steps."""
    arrivals = {0: [(16, 200)] * 4, 3: [(64, 8)] * 30}
    off_sizes, _, _ = _drive(_config(0), arrivals, 40)
    assert max(off_sizes[3:]) == 512
    sizes, streams, tokens_at = _drive(_config(), arrivals, 120)
    left = 30 * 64
    for k in range(3, 120):
        assert sizes[k] <= max(FLOOR, math.ceil(RATIO * streams[k]), streams[k] + math.ceil(left / SPREAD)), k
        left -= max(0, sizes[k] - streams[k])
    assert max(sizes[3:]) <= 4 + math.ceil(30 * 64 / SPREAD) < 512
    last_start = max(tokens_at[f"3.{i}"][0] for i in range(30))
    assert last_start - 3 <= SPREAD * math.log(30 * 64) + 10


@pytest.mark.parametrize("floor", [0, None])
def test_off_or_unset_is_the_full_step(floor):
    """0 turns the rule off; None (a bare Scheduler the engine has not filled in) means off too."""
    sched = Scheduler(_config(floor), BlockManager(64, 16, prefix_caching=False))
    sched.running.append(s := _seq("a", 4, 8))
    s.num_computed_tokens, s.output_token_ids = 4, [7]
    sched.add(_seq("b", 100, 8))
    assert sched.step_budget() == 512


@pytest.mark.parametrize("bad", [{"decode_step_tokens": -1}, {"decode_step_ratio": 0.5},
                                 {"prefill_spread_steps": 0}])
def test_bad_budget_settings_are_refused_with_their_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)
