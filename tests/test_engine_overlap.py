"""Overlapped steps (the CUDA backend's `chains_steps`): the engine launches a step before reading the last one's
tokens back, and must produce exactly what the plain step loop produces: tokens, text, stop reasons, logprobs,
streamed deltas, through admissions, aborts, stop strings and penalties (which fall back to the plain loop).

Runs the CUDA backend on CPU tensors (kernels under Triton's interpreter) with a tiny random llama that speaks
through SmolLM2's real tokenizer, so stop strings are real text.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, smollm_path):
    from ir.loader import load_model
    from tests.tiny_chat_model import save_tiny_chat_model

    return load_model(save_tiny_chat_model(tmp_path_factory.mktemp("chat"), smollm_path), progress=False)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def make_engine(model, overlap: bool, max_num_seqs: int = 8, device: str = "cpu"):
    from backends.cuda.backend import CUDABackend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    # fp32 on the GPU too (with CUDA graphs: the chained tokens then come from the graphs' input buffer)
    backend = CUDABackend(model, device=device, dtype="f32", progress=False)
    return LLMEngine(backend, EngineConfig(num_kv_blocks=96, block_size=8, async_scheduling=overlap,
                                           scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)))


def drive(engine, jobs, events=None) -> dict:
    """Steps until done; `events` {step: fn(engine)} runs before that step. Returns the final outputs of every
    request that finished, by id, after checking that streamed deltas add up to them and no placeholder shows."""
    for rid, p, sp in jobs:
        engine.add_request(p, sp, rid)
    streamed: dict[str, list[list[int]]] = {}
    final = {}
    step = 0
    while engine.has_unfinished():
        if events and step in events:
            events[step](engine)
        for out in engine.step():
            got = streamed.setdefault(out.request_id, [[] for _ in out.outputs])
            for c in out.outputs:
                assert -1 not in c.token_ids and -1 not in c.delta_token_ids
                got[c.index] += c.delta_token_ids
                assert got[c.index] == c.token_ids
            if out.finished:
                final[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                          [(lp.token, round(lp.logprob, 4)) for lp in c.logprobs or []])
                                         for c in out.outputs]
        step += 1
    assert engine.all_blocks_free()
    return final


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_steps_match_the_plain_loop(chat_model, device):
    from core.sampling_params import SamplingParams as P

    tok = chat_model.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "Once upon a time", "1, 2, 3,",
                                       "Hello there", "def main():", "Rain")]
    # A stop string and a stop token the model actually produces mid-answer, found by a first plain run.
    probe = drive(make_engine(chat_model, False, device=device),
                  [("probe", prompts[0], P(temperature=0, max_tokens=12))])
    ids, text = probe["probe"][0][:2]
    stop_text, stop_id = text[len(text) // 3: len(text) // 3 + 3], ids[5]
    assert stop_text.strip(), f"no text to stop on in {text!r}"
    params = [P(temperature=0, max_tokens=9),
              P(temperature=0.8, top_p=0.9, seed=5, max_tokens=10),
              P(temperature=1.1, top_k=30, seed=9, max_tokens=6, logprobs=2),
              P(temperature=0, max_tokens=12, stop=[stop_text]),
              P(temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=2),
              P(temperature=0.7, seed=1, n=2, max_tokens=7),
              P(temperature=0.9, seed=2, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=3),
              P(temperature=0, max_tokens=1)]
    jobs = [(f"r{i}", prompts[i % len(prompts)] if i != 3 else prompts[0], p) for i, p in enumerate(params)]
    jobs[4] = ("r4", prompts[0], params[4])
    plain_engine, overlap_engine = make_engine(chat_model, False, device=device), make_engine(chat_model, True,
                                                                                              device=device)
    plain, overlapped = drive(plain_engine, jobs), drive(overlap_engine, jobs)
    assert overlapped == plain
    assert plain["r3"][0][2:4] == ("stop", stop_text) and plain["r4"][0][2:4] == ("stop", stop_id)
    assert plain_engine.stats["overlapped_steps"] == 0
    # The penalised request keeps the loop plain while it runs; the rest of the time steps overlap.
    assert overlap_engine.stats["overlapped_steps"] >= 4


def test_overlapped_steps_through_admissions_and_aborts(chat_model):
    """A request arrives mid-run and another is aborted while its step is in flight: the survivors' tokens are
    the plain loop's, the aborted one's blocks come back, and nothing is reported for it after the abort."""
    from core.sampling_params import SamplingParams as P

    tok = chat_model.tokenizer
    greedy = P(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = P(temperature=0.8, seed=4, max_tokens=10, ignore_eos=True)
    jobs = [("a", tok.encode("The weather today"), greedy), ("b", tok.encode("My favourite food"), seeded)]
    late = ("c", tok.encode("Numbers: 4, 8,"), seeded)
    events = {3: lambda e: e.add_request(late[1], late[2], late[0]), 5: lambda e: e.abort_request("b")}
    runs = []
    for overlap in (False, True):
        engine = make_engine(chat_model, overlap)
        runs.append(drive(engine, jobs, events))
        assert sorted(runs[-1]) == ["a", "c"]  # "b" was aborted: never reported finished
    assert runs[0] == runs[1]
    assert engine.stats["overlapped_steps"] > 0


def test_late_request_matches_alone(chat_model):
    """A request admitted while others' steps are in flight gets the tokens it gets alone (seeded sampling)."""
    from core.sampling_params import SamplingParams as P

    tok = chat_model.tokenizer
    seeded = P(temperature=0.8, seed=4, max_tokens=8, ignore_eos=True)
    late = tok.encode("Numbers: 4, 8,")
    alone = drive(make_engine(chat_model, False), [("c", late, seeded)])["c"]
    engine = make_engine(chat_model, True)
    crowd = drive(engine, [("a", tok.encode("The weather today"), P(temperature=0, max_tokens=12, ignore_eos=True))],
                  {3: lambda e: e.add_request(late, seeded, "c")})
    assert crowd["c"] == alone
    assert engine.stats["overlapped_steps"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_steps_that_admit_and_prefill_prompts_are_chained(chat_model, device):
    """Prompts that arrive while a stream decodes enter in chunks under the decode-step budget; those steps are
    launched before the last one's tokens are read back (no idle device while the host schedules), and every
    token is the plain loop's."""
    from backends.cuda.backend import CUDABackend
    from core.sampling_params import SamplingParams as P
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    tok = chat_model.tokenizer
    backend = CUDABackend(chat_model, device=device, dtype="f32", progress=False)  # on a GPU: graphs, pieces
    seeded = P(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    long_prompt = tok.encode("A list of fruit: apple, banana, cherry, damson, elderberry, fig, grape, honeydew")
    jobs = [("a", tok.encode("The weather today"), P(temperature=0, max_tokens=24, ignore_eos=True))]
    events = {3: lambda e: e.add_request(long_prompt, seeded, "b"),
              6: lambda e: e.add_request(long_prompt[5:], seeded, "c")}
    runs, engines = [], []
    for overlap in (False, True):
        engine = LLMEngine(backend, EngineConfig(num_kv_blocks=64, block_size=8, async_scheduling=overlap,
                                                 scheduler=SchedulerConfig(max_num_seqs=4, prefill_chunk_size=16,
                                                                           decode_step_tokens=4)))
        runs.append(drive(engine, jobs, events))
        engines.append(engine)
    assert runs[0] == runs[1] and sorted(runs[1]) == ["a", "b", "c"]
    stats = engines[1].stats
    assert len(long_prompt) > 2 * engines[1].scheduler.config.decode_step_tokens  # "b" took several steps to enter
    # only the first step (nothing to chain behind) and the last (every token in flight ends its sequence) are not
    assert stats["overlapped_steps"] >= stats["steps"] - 2, stats


def test_a_new_stream_samples_its_second_token_in_the_very_next_step(chat_model):
    """Overlapped steps read a step's tokens back during the next one; a prompt whose last chunk runs in step N (a
    chained step, beside decoding streams and other prompts' chunks) is in step N+1's decode batch, so each request's
    tokens are reported one a step, from its first to its last, never with a step skipped between them."""
    from backends.cuda.backend import CUDABackend
    from core.sampling_params import SamplingParams as P
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    tok = chat_model.tokenizer
    engine = LLMEngine(CUDABackend(chat_model, device="cpu", dtype="f32", progress=False),
                       EngineConfig(num_kv_blocks=64, block_size=8,
                                    scheduler=SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8)))
    greedy = P(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(tok.encode("The weather today"), P(temperature=0, max_tokens=14, ignore_eos=True), "a")
    arrivals = {2: [("b", "A list of fruit: apple, banana, cherry, damson")], 4: [("c", "Hello"), ("d", "Rain")]}
    reported: dict[str, list[int]] = {}  # request -> the step that reported each of its tokens
    step = 0
    while engine.has_unfinished():
        for rid, text in arrivals.get(step, ()):
            engine.add_request(tok.encode(text), greedy, rid)
        for out in engine.step():
            reported.setdefault(out.request_id, []).extend([step] * len(out.outputs[0].delta_token_ids))
        step += 1
    assert engine.stats["overlapped_steps"] >= engine.stats["steps"] - 2
    assert len(reported["b"]) == 6 and len(tok.encode("A list of fruit: apple, banana, cherry, damson")) > 8
    for rid, steps in reported.items():
        assert steps == list(range(steps[0], steps[0] + len(steps))), (rid, steps)
