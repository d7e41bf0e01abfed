"""The engine over a model of two KV groups (gemma3's tiny random model: two sliding layers, one global): several
sequences with preemptions, an abort, n > 1 siblings and prefix-cache hits, each output what the sequence gives
alone (tokens, logprobs), and every block of both pools free at the end. tests/test_group_blocks.py checks the same
rules without a model, count by count."""

from __future__ import annotations

import numpy as np
import pytest
from test_arch_gemma import WINDOW, make_hf, prompt
from tiny_hf import saved_models

from core.sampling_params import SamplingParams
from frontend.engine.engine import EngineConfig, LLMEngine
from frontend.engine.scheduler import SchedulerConfig

BS, NEW = 4, 20


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return saved_models(tmp_path_factory, make_hf, load=True)("gemma3")[2]


def mlx(loaded):
    """The block accounting is the engine's whatever the backend (tests/test_kv_groups_gemma.py runs each one)."""
    from backends.mlx.backend import MLXBackend

    return MLXBackend(loaded, progress=False)


def engine(backend, blocks: int = 256, **kw) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 8), max_num_batched_tokens=24, prefill_chunk_size=8)
    return LLMEngine(backend, EngineConfig(block_size=BS, num_kv_blocks=blocks, scheduler=sched, **kw))


def run(eng: LLMEngine, prompts, params, abort_after: int | None = None, abort: int = 0):
    """Everything submitted at once; outputs by request (an aborted one's too), after stepping until done."""
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done, steps = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == abort_after:
            eng.abort_request(rids[abort])
    assert eng.all_blocks_free(), [(p.num_free_blocks, p.num_blocks) for p in eng.blocks.pools]
    return [done.get(r) for r in rids]


def same(a, b) -> None:
    """Same tokens, logprobs equal to float rounding (other batches, other blocks)."""
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def test_crowd_preemption_abort_and_siblings(gemma3):
    backend = mlx(gemma3)
    prompts = [prompt(10 + i, n) for i, n in enumerate((42, 23, 37, 30, 19, 41))]
    prompts[3] = prompts[0][:28] + prompts[3][:9]  # shares 7 blocks with the first: a prefix hit, if still cached
    alone = [run(engine(backend), [p], [GREEDY])[0].outputs[0] for p in prompts]
    # Room in group 0 for two whole sequences and a block: more are admitted on their prompts, then outgrow it.
    crowd = engine(backend, blocks=2 * -(-(42 + NEW) // BS) + 1)
    params = [GREEDY] * len(prompts)
    params[5] = SamplingParams(n=2, temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = run(crowd, prompts, params, abort_after=6, abort=4)
    assert crowd.scheduler.num_preemptions > 0
    assert outs[4] is None or outs[4].outputs[0].finish_reason == "abort"
    for i in (0, 1, 2, 3):
        same(outs[i].outputs[0], alone[i])
    assert [c.index for c in outs[5].outputs] == [0, 1]
    for c in outs[5].outputs:
        same(c, alone[5])


def test_prefix_cache_hits_give_the_same_output(gemma3):
    backend = mlx(gemma3)
    long = prompt(20, 7 * WINDOW)
    branch = long[:30] + prompt(21, 7)  # 7 full blocks shared, then its own
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    cached = engine(backend)
    first = run(cached, [long], [params])[0]  # nothing cached yet: what the prompt gives without a hit
    again, other = run(cached, [long, branch], [params, params])
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 40  # every full block below the last token: both groups still hold them
    assert other.num_cached_tokens == 28
    same(again.outputs[0], first.outputs[0])
    same(other.outputs[0], run(engine(backend, prefix_caching=False), [branch], [params])[0].outputs[0])
