"""The scheduler's burst rule through the real engine: a burst of prompts arriving while streams decode is
prefilled first, decodes paused, so each running stream waits one long gap for the burst instead of one per step of
it; the pause ends, never deadlocks, and small arrivals ride beside the decodes. Gaps are counted in the tokens the
engine computed in between (the cost model's measure of a step's time: no clocks)."""

from __future__ import annotations

import numpy as np
import pytest
from step_tokens import counted_steps

from core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_backend(tmp_path_factory, smollm_path):
    from backends.mlx.backend import MLXBackend
    from ir.loader import load_model
    from tests.tiny_chat_model import save_tiny_chat_model

    model = load_model(save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), smollm_path), progress=False)
    return MLXBackend(model, progress=False)


def _run(backend, burst_tokens: int, arrivals: dict[int, list[int]], max_num_seqs: int = 32):
    """Four streams decode 30 tokens; at step s, prompts of the lengths arrivals[s] arrive (4 new tokens each).
    Returns each stream's gaps, each new prompt's first-token step, the greedy tokens of every request and the
    engine."""
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    engine = LLMEngine(backend, EngineConfig(num_kv_blocks=128, block_size=16, scheduler=SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=64, prefill_burst_tokens=burst_tokens)))
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    streams = [engine.add_request(rng.integers(300, 9000, 8).tolist(), greedy) for _ in range(4)]
    at: dict[str, list[int]] = {rid: [] for rid in streams}
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in streams}  # in the order of submission
    with counted_steps(backend) as computed:
        step = 0
        while engine.has_unfinished():
            for n in arrivals.get(step, ()):
                rid = engine.add_request(rng.integers(300, 9000, n).tolist(),
                                         SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
                first[rid], tokens[rid] = -1, []
            for out in engine.step():
                new = out.outputs[0].delta_token_ids
                tokens[out.request_id] += new
                if out.request_id in at:
                    at[out.request_id] += [sum(computed)] * len(new)
                elif new and first[out.request_id] < 0:
                    first[out.request_id] = step
            step += 1
    assert engine.all_blocks_free()
    assert all(len(tokens[r]) == 30 for r in streams) and all(len(tokens[r]) == 4 for r in first)
    return [np.diff(v) for v in at.values()], first, tokens, engine


BURST = {4: [48] * 6}  # 288 prompt tokens at once: 5 steps of 64


def _long_gaps(gaps) -> list[int]:
    """Gaps holding more than half a step's budget of tokens: a decode step here is 4-10 tokens."""
    return [int((g > 32).sum()) for g in gaps]


def test_a_burst_costs_each_stream_one_long_gap(tiny_backend):
    gaps, first, tokens, engine = _run(tiny_backend, 32, BURST)
    assert engine.scheduler.num_paused_steps == 5  # 288 tokens in steps of 64, nothing else in them
    assert _long_gaps(gaps) == [1, 1, 1, 1], gaps
    off_gaps, off_first, off_tokens, off = _run(tiny_backend, 0, BURST)
    assert off.scheduler.num_paused_steps == 0
    assert min(_long_gaps(off_gaps)) >= 4, off_gaps  # mixed: a long gap per step of the burst
    # the pause delays no stream's finish, and no prompt's first token comes later than in mixed steps
    assert max(g.sum() for g in gaps) <= max(g.sum() for g in off_gaps)
    assert sorted(first.values()) <= sorted(off_first.values())
    assert list(tokens.values()) == list(off_tokens.values())  # greedy: the same tokens whichever steps held them


def test_arrivals_during_a_pause_do_not_extend_it(tiny_backend):
    arrivals = {4: [48] * 6, **{s: [40] for s in range(5, 40)}}  # a prompt every step from then on
    gaps, _, _, engine = _run(tiny_backend, 32, arrivals, max_num_seqs=64)
    # each pause prefills what waited when it began (<= 5 steps of 64 here), then a step with every decode: no
    # stream waits more than one pause's worth of tokens for its next one
    assert max(g.max() for g in gaps) <= 6 * 64 + 8, gaps
    assert engine.scheduler.num_paused_steps >= 5


def test_a_burst_that_cannot_be_admitted_whole_ends(tiny_backend):
    # max_num_seqs 6: 2 of the 6 prompts fit beside the 4 streams; the rest wait for streams to finish, which only
    # steps with decodes can do
    gaps, first, _, engine = _run(tiny_backend, 32, BURST, max_num_seqs=6)
    assert all(s >= 0 for s in first.values())
    assert engine.scheduler.burst is None


def test_small_arrivals_ride_beside_the_decodes(tiny_backend):
    gaps, _, _, engine = _run(tiny_backend, 100, {4: [24], 9: [24, 24]})  # below the threshold each time
    assert engine.scheduler.num_paused_steps == 0
    _, _, _, default = _run(tiny_backend, None, {4: [24]})  # unset: the backend's own (off on a CPU)
    assert default.scheduler.config.prefill_burst_tokens == tiny_backend.prefill_burst_tokens == 0


def test_the_step_size_defaults_to_the_backend_s(tiny_backend):
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    engine = LLMEngine(tiny_backend, EngineConfig(num_kv_blocks=64, scheduler=SchedulerConfig(
        max_num_batched_tokens=None)))
    assert engine.scheduler.config.max_num_batched_tokens == tiny_backend.default_step_tokens == 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
