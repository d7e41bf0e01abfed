"""The engine on SmolLM2 through the MLX backend: batch invariance, seeds, preemption, prefix
sharing, chunked prefill, n > 1, stops, aborts. The `make_engine` fixture checks after every test
that all KV blocks are free again."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams
from ir.reference import ReferenceRunner

TOPICS = ["France", "the moon", "cats", "python lists", "rain", "bread", "the ocean", "chess", "music",
          "trains", "winter", "volcanoes", "bees", "the internet", "coffee", "gravity"]


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def prompts(smollm):
    return [chat(smollm.tokenizer, f"Tell me one fact about {t}.") for t in TOPICS]


def run(engine, prompts, params):
    """Submit everything at once and step until done; outputs in submission order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_greedy_matches_reference(smollm, make_engine):
    ids = chat(smollm.tokenizer, "What is the capital of France?")
    ref, _ = ReferenceRunner(smollm).greedy([ids], 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = run(make_engine(), [ids], [params])[0].outputs[0]
    assert out.token_ids == ref[0]
    assert "Paris" in out.text and out.finish_reason == "length"


def test_batch_invariance_greedy(prompts, make_engine):
    engine = make_engine()
    together = tokens(run(engine, prompts, [GREEDY] * len(prompts)))
    alone = [tokens(run(engine, [p], [GREEDY]))[0] for p in prompts[::2]]  # every other one: half the time
    assert together[::2] == alone
    assert len({tuple(t[0]) for t in together}) > 8, "different prompts should give different answers"


def test_seeded_request_same_alone_and_in_a_crowd(prompts, make_engine):
    engine = make_engine()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens(run(engine, [prompts[0]], [seeded]))[0]
    others = [SamplingParams(temperature=t, top_k=k, max_tokens=12 + i, ignore_eos=True)
              for i, (t, k) in enumerate([(0.7, 0), (1.3, 20), (0, 0)] * 4)]
    crowd = tokens(run(engine, [prompts[0]] + prompts[1:13], [seeded] + others))[0]
    assert crowd == alone
    unseeded = {tuple(tokens(run(engine, [prompts[0]], [SamplingParams(temperature=1.0, max_tokens=16,
                                                                          ignore_eos=True)]))[0][0])
                for _ in range(3)}
    assert len(unseeded) > 1, "requests without a seed should not all sample the same tokens"


def test_preemption_loses_nothing(prompts, make_engine):
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 8
    relaxed = tokens(run(make_engine(), prompts[:8], params))
    longest = max(len(p) for p in prompts[:8]) + 20
    per_seq = -(-longest // 16)
    # Room for two whole sequences plus a block: a third is admitted on its prompt, then they outgrow it.
    tight = make_engine(num_kv_blocks=2 * per_seq + 1, prefix_caching=False)
    squeezed = tokens(run(tight, prompts[:8], params))
    assert squeezed == relaxed
    assert tight.scheduler.num_preemptions > 0, "the budget was meant to force preemptions"


def test_chunked_prefill_and_small_token_budget(prompts, make_engine):
    params = [GREEDY] * 4
    base = tokens(run(make_engine(), prompts[:4], params))
    chunked = make_engine(prefill_chunk_size=7, max_num_batched_tokens=20)
    assert tokens(run(chunked, prompts[:4], params)) == base


def test_prefix_cache_hits_give_same_output(prompts, make_engine):
    engine = make_engine()
    first = run(engine, [prompts[0]], [GREEDY])[0]
    second = run(engine, [prompts[0]], [GREEDY])[0]
    assert second.num_cached_tokens >= (len(prompts[0]) - 1) // 16 * 16 > 0
    assert tokens([second]) == tokens([first])


def test_n_siblings_share_prompt_blocks(prompts, make_engine):
    engine = make_engine()
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    rid = engine.add_request(prompts[1], params)
    shared = False
    while engine.has_unfinished():
        outs = engine.step()
        seqs = [s for s in engine.scheduler.running if s.request_id == rid]
        if len(seqs) == 3:
            shared = shared or (seqs[0].block_table[0] == seqs[1].block_table[0] == seqs[2].block_table[0])
        for o in outs:
            if o.finished:
                result = o
    assert shared, "siblings should hold the prompt's first block together"
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in result.outputs)
    assert len({tuple(c.token_ids) for c in result.outputs}) > 1


def test_stop_string_and_eos(smollm, make_engine):
    engine = make_engine()
    ids = chat(smollm.tokenizer, "What is the capital of France?")
    out = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=32, stop=["Paris"])])[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "Paris" not in out.text and out.text.startswith("The capital of France is")
    eos = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=64)])[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in engine.eos_ids
    assert "<|im_end|>" not in eos.text


def test_min_tokens_and_stop_token_ids(smollm, make_engine):
    engine = make_engine()
    ids = chat(smollm.tokenizer, "What is the capital of France?")
    plain = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=64)])[0].outputs[0]
    n = len(plain.token_ids)
    longer = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3)])[0].outputs[0]
    assert len(longer.token_ids) >= n + 3
    assert not set(longer.token_ids[: n + 3]) & engine.eos_ids
    target = plain.token_ids[2]
    cut = run(engine, [ids], [SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[target])])[0]
    assert cut.outputs[0].token_ids == plain.token_ids[:3] and cut.outputs[0].stop_reason == target


def test_abort_frees_blocks_at_once(prompts, make_engine):
    engine = make_engine()
    rid = engine.add_request(prompts[2], SamplingParams(max_tokens=200, ignore_eos=True))
    keep = engine.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=4))
    for _ in range(3):
        engine.step()
    held = engine.blocks.num_blocks - engine.blocks.num_free_blocks
    engine.abort_request(rid)
    assert engine.blocks.num_blocks - engine.blocks.num_free_blocks < held
    while engine.has_unfinished():
        engine.step()
    assert keep not in engine.requests


def test_streamed_deltas_add_up(prompts, make_engine):
    engine = make_engine()
    rid = engine.add_request(prompts[4], SamplingParams(temperature=0, max_tokens=20))
    text, ids, final = "", [], None
    while engine.has_unfinished():
        for o in engine.step():
            text += o.outputs[0].delta_text
            ids += o.outputs[0].delta_token_ids
            final = o
    assert final.request_id == rid and final.finished
    assert text == final.outputs[0].text and ids == final.outputs[0].token_ids


def test_logprobs_are_reported(prompts, make_engine):
    engine = make_engine()
    out = run(engine, [prompts[5]], [SamplingParams(temperature=0, max_tokens=5, logprobs=3)])[0].outputs[0]
    assert len(out.logprobs) == 5
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the sampled token is the most likely


def test_bad_requests_are_refused(prompts, make_engine):
    engine = make_engine(num_kv_blocks=8)
    with pytest.raises(ValueError, match="KV cache holds 128 tokens"):
        engine.add_request(prompts[0], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request(prompts[0], SamplingParams(max_tokens=100_000))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 2, 10**7], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())


def test_offline_llm_api(mlx_smollm):
    from frontend.engine.engine import EngineConfig
    from frontend.engine.llm import LLM

    llm = LLM.from_backend(mlx_smollm, EngineConfig(num_kv_blocks=64))
    outs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "Name a colour."}]], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in outs[0].outputs[0].text and outs[1].outputs[0].text
    texts = llm.generate(["The capital of France is", [1, 504, 3575]], SamplingParams(temperature=0, max_tokens=4))
    assert [len(t.outputs[0].token_ids) for t in texts] == [4, 4]
    with pytest.raises(ValueError, match="2 prompts but 3"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    assert llm.engine.all_blocks_free()
