"""The decode-step budget through the real engine: while new prompts keep arriving, a decoding stream's largest gap
between two tokens, counted in the tokens the engine computed in between (the cost model's measure of a step's time:
no clocks), stays within a bound of its typical gap; with the budget off (0) whole prompts land in one step."""

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


def _gaps(backend, decode_step_tokens: int | None) -> tuple[list[np.ndarray], object]:
    """Four streams decode while two 48-token prompts arrive every third step; each stream's gaps in tokens
    computed, and the engine."""
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    engine = LLMEngine(backend, EngineConfig(num_kv_blocks=128, block_size=16, scheduler=SchedulerConfig(
        max_num_seqs=32, max_num_batched_tokens=512, decode_step_tokens=decode_step_tokens)))
    rng = np.random.default_rng(0)
    streams = [engine.add_request(rng.integers(300, 9000, 8).tolist(), SamplingParams(max_tokens=40, ignore_eos=True))
               for _ in range(4)]
    at: dict[str, list[int]] = {rid: [] for rid in streams}  # tokens computed when each new token was reported
    with counted_steps(backend) as computed:
        step = 0
        while engine.has_unfinished():
            if 3 <= step < 36 and step % 3 == 0:
                for _ in range(2):
                    engine.add_request(rng.integers(300, 9000, 48).tolist(),
                                       SamplingParams(max_tokens=4, ignore_eos=True))
            for out in engine.step():
                if out.request_id in at:
                    at[out.request_id] += [sum(computed)] * len(out.outputs[0].delta_token_ids)
            step += 1
    assert engine.all_blocks_free()
    return [np.diff(v) for v in at.values()], engine


def test_a_stream_s_largest_gap_stays_near_its_typical_one(tiny_backend):
    knee = 8  # a CPU's backend sets none (the budget off by default there): a GPU-like floor, asked for
    gaps, engine = _gaps(tiny_backend, knee)
    assert engine.scheduler.config.decode_step_tokens == knee
    for g in gaps:
        assert len(g) == 39
        # a step holds at most max(knee, 1.5 x streams, streams + 1/16 of the prompt tokens left): here about 2x
        # the median step, where whole prompts would be 48+ tokens
        assert g.max() <= 2 * max(knee, np.median(g)), g
    off, _ = _gaps(tiny_backend, 0)
    assert max(g.max() for g in off) >= 2 * 48  # the same arrivals without the budget: whole prompts in a step
    _, engine = _gaps(tiny_backend, None)  # unset: the backend's own (0 on a CPU)
    assert engine.scheduler.config.decode_step_tokens == tiny_backend.step_knee_tokens == 0
