"""A step's host work is O(new tokens), not O(output so far) (issue 15): checked by counting what a step reads of
each sequence's history, never by timing. The engine is the real one with the real SmolLM2 tokenizer; only the
forward pass is a stub (tools.bench_engine_host's, whose logits cost nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from core.sampler import TokenHistory, adjusted_logits
from core.sampling_params import SamplingParams
from frontend.engine.detokenizer import IncrementalDetokenizer
from frontend.engine.engine import EngineConfig, LLMEngine
from frontend.engine.scheduler import SchedulerConfig
from tools.bench_engine_host import StubBackend

GEN = 240


class WatchedList(list):
    """A list that counts the items read by slices and whole-list iteration (list(), numpy conversion, for ...)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.touched = 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            self.touched += len(range(*i.indices(len(self))))
        return super().__getitem__(i)

    def __iter__(self):
        self.touched += len(self)
        return super().__iter__()

    def __add__(self, other):
        self.touched += len(self)
        return super().__add__(other)


PARAMS = {
    "plain": {},
    "stop strings": {"stop": ["never appears", "zzz"]},  # text held back and searched every token
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1},
    "logprobs": {"logprobs": 2},
}


@pytest.fixture
def text_reads(monkeypatch):
    """How often anything reads a detokenizer's whole text."""
    reads = [0]
    whole = IncrementalDetokenizer.text

    def counted(self):
        reads[0] += 1
        return whole.fget(self)

    monkeypatch.setattr(IncrementalDetokenizer, "text", property(counted))
    return reads


@pytest.mark.parametrize("kind", PARAMS)
def test_a_step_reads_only_what_is_new(smollm, text_reads, kind):
    engine = LLMEngine(StubBackend(smollm.tokenizer), EngineConfig(
        num_kv_blocks=256, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, **PARAMS[kind])
    rids = [engine.add_request(rng.integers(300, 1000, 40).tolist(), params) for _ in range(4)]
    seqs = [s for r in rids for s in engine.requests[r].seqs]
    for s in seqs:
        s.output_token_ids, s.block_hashes, s.block_table = WatchedList(), WatchedList(), WatchedList()
    watched = [lst for s in seqs for lst in (s.output_token_ids, s.block_hashes, s.block_table)]
    per_step, reports = [], {r: [] for r in rids}
    final = {}
    while engine.has_unfinished():
        before = sum(w.touched for w in watched)
        outs = engine.step()
        per_step.append(sum(w.touched for w in watched) - before)
        for out in outs:
            reports[out.request_id].append((out.outputs[0], list(out.outputs[0].delta_token_ids),
                                            out.outputs[0].delta_text))
            if out.finished:
                final[out.request_id] = out
    assert text_reads[0] == 0, "a step read a whole detokenized text"
    # The reads a step makes stay what they were at the start (a few items a sequence, a block's tokens once it
    # fills), however long the outputs have grown; copying a history once per step would read ~4 x GEN here.
    early, late = max(per_step[2:40]), max(per_step[-40:-1])
    assert late <= early <= 4 * 16 + 8, (early, late)
    for rid in rids:
        out = final[rid].outputs[0]
        assert len(out.token_ids) == GEN
        assert out.text == smollm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        # Each report, read only now, says what it said when it was made: the prefix its deltas had reached.
        ids, text = [], ""
        for report, delta_ids, delta_text in reports[rid]:
            ids += delta_ids
            text += delta_text
            assert report.token_ids == ids and report.num_tokens == len(ids)
            assert report.text == text and report.text_len == len(text)
            assert list(report.token_view[-3:]) == ids[-3:]


def test_token_history_gives_the_penalties_of_the_lists():
    """The penalties read a TokenHistory kept one token at a time; they must equal the ones read off the lists."""
    rng = np.random.default_rng(1)
    vocab = 50

    class Row:
        def __init__(self, params, prompt, history):
            self.params, self.prompt_token_ids, self.output_token_ids = params, prompt, []
            self.history = history

    for trial in range(60):
        params = SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2)),
                                frequency_penalty=float(rng.uniform(-2, 2)), presence_penalty=float(rng.uniform(-2, 2)),
                                logit_bias={int(rng.integers(vocab)): 3.0} if trial % 2 else None)
        prompt = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        lists, counted = Row(params, prompt, None), Row(params, prompt, TokenHistory(prompt))
        for _ in range(int(rng.integers(0, 80))):
            token = int(rng.integers(0, vocab))
            lists.output_token_ids.append(token)
            counted.output_token_ids.append(token)
            counted.history.add(token)
            logits = rng.standard_normal(vocab).astype(np.float32)
            assert np.array_equal(adjusted_logits(logits, lists), adjusted_logits(logits, counted))
