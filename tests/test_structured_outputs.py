"""Structured outputs in the engine: every output of SmolLM2 and of random-weight tiny models, sampled at temperature
1 with seeds, matches its JSON schema (checked by jsonschema), regex, choice or Lark grammar and ends with "stop"; the
mask works through overlapped (chained) steps, n > 1 and preemption; the samplers agree on masked rows."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

from core.sampling_params import SamplingParams, StructuredOutput
from tests.structured_cases import CHOICES, GRAMMAR, GRAMMAR_RE, REGEX, SCHEMAS, check_json

torch = pytest.importorskip("torch")


def constrained_jobs(tok, chat: bool, max_tokens: int, seed: int = 0, n: int = 1):
    """(prompt ids, params, check) for the 20 schemas, the regex, the choice and the grammar. The prompts are short
    and shared where they can be (the prefix cache then prefills them once): the mask, not the prompt, is tested."""
    def prompt(what: str) -> list[int]:
        if chat:
            return tok.apply_chat_template([{"role": "user", "content": what}])
        return tok.encode(what)

    def params(kind: str, spec: str | None, i: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens, n=n,
                              structured=StructuredOutput(kind, spec), **kw)

    ask = prompt("Describe a thing in JSON.")
    jobs = [(ask, params("json_schema", json.dumps(s), i), lambda t, s=s: check_json(t, s))
            for i, s in enumerate(SCHEMAS)]
    jobs.append((prompt("Give a plate number like AB-123."), params("regex", REGEX, 20),
                 lambda t: _full(REGEX, t)))
    jobs.append((prompt("Should I go out? Answer yes, no or maybe later."), params("choice", json.dumps(CHOICES), 21),
                 lambda t: _in(t, CHOICES)))
    jobs.append((prompt("Write a sum of small numbers."), params("grammar", GRAMMAR, 22),
                 lambda t: _full(GRAMMAR_RE.pattern, t)))
    return jobs


def _full(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), (pattern, text)


def _in(text: str, choices: list[str]) -> None:
    assert text in choices, text


def run_all(engine, jobs) -> list:
    ids = [engine.add_request(p, sp) for p, sp, _ in jobs]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.all_blocks_free()
    return [done[i] for i in ids]


def check_all(outs, jobs) -> None:
    for out, (_, _, check) in zip(outs, jobs, strict=True):
        for c in out.outputs:
            assert out.error is None, out.error
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            check(c.text)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, smollm_path):
    """A tiny random llama over SmolLM2's tokenizer: on random weights only the mask makes the output valid."""
    from ir.loader import load_model
    from tests.tiny_chat_model import save_tiny_chat_model

    return load_model(save_tiny_chat_model(tmp_path_factory.mktemp("chat"), smollm_path, max_len=512),
                      progress=False)


def test_smollm_outputs_match_their_schemas(make_engine, smollm):
    jobs = constrained_jobs(smollm.tokenizer, chat=True, max_tokens=160)
    engine = make_engine(max_num_seqs=32, num_kv_blocks=384)
    check_all(run_all(engine, jobs), jobs)


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory, smollm_path):
    """A tiny random Qwen3 whose vocabulary is a tokenizer.json folder (the HF path; chat_model's is the GGUF's)."""
    from ir.loader import load_model
    from tests.tiny_hf import save_tiny_chat_qwen3

    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_chat_qwen3(folder, smollm_path)
    return load_model(folder, progress=False)


@pytest.mark.parametrize("which, max_tokens", [("chat_model", 400), ("qwen3_model", 240)])
def test_random_tiny_model_outputs_match_their_schemas_on_mlx(request, which, max_tokens):
    from backends.mlx.backend import MLXBackend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    model = request.getfixturevalue(which)
    engine = LLMEngine(MLXBackend(model, progress=False),
                       EngineConfig(num_kv_blocks=512, block_size=16, scheduler=SchedulerConfig(max_num_seqs=32)))
    jobs = constrained_jobs(model.tokenizer, chat=False, max_tokens=max_tokens, seed=100)
    check_all(run_all(engine, jobs), jobs)


def cuda_engine(model, overlap: bool, num_kv_blocks: int = 256):
    from backends.cuda.backend import CUDABackend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    backend = CUDABackend(model, device="cpu", dtype="f32", progress=False)
    return LLMEngine(backend, EngineConfig(num_kv_blocks=num_kv_blocks, block_size=8, async_scheduling=overlap,
                                           scheduler=SchedulerConfig(max_num_seqs=16)))


def tokens(outs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_chained_steps_sample_constrained_rows_after_the_read_back(chat_model):
    """The CUDA backend (on CPU tensors) chains steps: a step's forward is launched before the last step's tokens
    are read, and its constrained rows are sampled once their masks know those tokens. Seeded outputs, n = 2, equal
    the plain loop's token for token, and every one is valid."""
    tok = chat_model.tokenizer
    jobs = [j for i, j in enumerate(constrained_jobs(tok, chat=False, max_tokens=300, seed=7, n=2))
            if i in (3, 13, 20, 21)]
    plain, chained = cuda_engine(chat_model, False), cuda_engine(chat_model, True)
    want, got = run_all(plain, jobs), run_all(chained, jobs)
    check_all(got, jobs)
    assert tokens(got) == tokens(want)
    assert chained.stats["overlapped_steps"] >= 5 and plain.stats["overlapped_steps"] == 0
    assert chained.masks.filled_off_thread >= 5 and plain.masks.filled_off_thread == 0


def test_preempted_sequences_keep_their_matchers(chat_model):
    """Preemption (recompute) keeps a sequence's output, so its matcher stays where it was: with too few KV blocks
    for the batch, sequences are preempted and still produce the tokens of an unhindered run, all valid."""
    from backends.mlx.backend import MLXBackend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    backend = MLXBackend(chat_model, progress=False)
    jobs = constrained_jobs(chat_model.tokenizer, chat=False, max_tokens=150, seed=40)[:12]

    def engine(blocks: int):
        return LLMEngine(backend, EngineConfig(num_kv_blocks=blocks, block_size=4, prefix_caching=False,
                                               scheduler=SchedulerConfig(max_num_seqs=16)))

    roomy = engine(1024)  # one after the other: an engine (re)allocates the shared backend's KV cache
    want = run_all(roomy, jobs)
    tight = engine(40)
    got = run_all(tight, jobs)
    assert tight.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
    check_all(got, jobs)
    assert tokens(got) == tokens(want)


class _Row:
    def __init__(self, params: SamplingParams, mask, seed: int):
        from core.sampler import make_generator

        self.params, self.token_mask, self.generator = params, mask, make_generator(seed)
        self.prompt_token_ids, self.output_token_ids, self.history = [1, 2], [3], None


def test_samplers_apply_the_mask_alike_and_logprobs_stay_raw():
    """Random logits and masks: numpy's and torch's samplers draw the same tokens, always allowed ones, under
    greedy, temperature, top_k/top_p and logit_bias; the reported logprobs are the unmasked distribution's."""
    from backends.cuda.sampling import TorchSampler
    from core.sampler import Sampler, allowed_tokens

    rng = np.random.default_rng(0)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = rng.normal(0, 3, (6, vocab)).astype(np.float32)
    masks = [rng.integers(-2**31, 2**31, (vocab + 31) // 32, dtype=np.int64).astype(np.int32) for _ in range(6)]
    masks[4] = np.zeros_like(masks[4])
    masks[4][3] = 1 << 5  # one token allowed: 3 * 32 + 5
    kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(top_p=0.8),
             dict(temperature=0), dict(temperature=1.0, logit_bias={7: 50.0}, logprobs=3)]
    for trial in range(3):
        def rows(trial: int = trial):
            return [_Row(SamplingParams(**k), m if i != 2 or trial else None, 10 * trial + i)
                    for i, (k, m) in enumerate(zip(kinds, masks, strict=True))]
        ours = Sampler()(logits, rows())
        theirs = TorchSampler()(torch.from_numpy(logits), rows())
        assert [r.token for r in ours] == [r.token for r in theirs]
        for i, r in enumerate(ours):
            if i != 2 or trial:
                assert allowed_tokens(masks[i], vocab)[r.token], (i, r.token)
        assert ours[4].token == 3 * 32 + 5
        raw = logits[5] - np.logaddexp.reduce(logits[5].astype(np.float64))
        assert ours[5].logprob == pytest.approx(raw[ours[5].token], abs=1e-5)
        assert [t for t, _ in ours[5].top_logprobs] == list(np.argsort(-logits[5])[:3])  # masked or not
        assert not all(allowed_tokens(masks[5], vocab)[t] for t, _ in ours[5].top_logprobs) or trial


def test_greedy_masked_rows_take_the_masked_argmax():
    """The torch sampler's greedy path under masks (every row greedy: no host arrays, the words through its pinned
    slots): the same tokens as numpy's sampler with every row masked, some rows, and across steps of other sizes."""
    from backends.cuda.sampling import TorchSampler
    from core.sampler import Sampler, allowed_tokens

    rng = np.random.default_rng(1)
    vocab = 1000
    sampler = TorchSampler()  # one across the steps, as the backend keeps it
    changed = 0

    def sparse(words: int):  # about one token in eight allowed: the mask decides most rows' choice
        r = [rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32) for _ in range(3)]
        return r[0] & r[1] & r[2]

    for n, masked in ((4, {0, 1, 2, 3}), (6, {1, 4}), (3, {2}), (6, set(range(6)))):
        logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
        masks = [sparse((vocab + 31) // 32) for _ in range(n)]
        rows = [_Row(SamplingParams(temperature=0), masks[i] if i in masked else None, i) for i in range(n)]
        ours = [r.token for r in Sampler()(logits, rows)]
        theirs = [r.token for r in sampler(torch.from_numpy(logits), rows)]
        assert ours == theirs
        for i in masked:
            assert allowed_tokens(masks[i], vocab)[theirs[i]]
            changed += theirs[i] != int(np.argmax(logits[i]))
        assert all(theirs[i] == int(np.argmax(logits[i])) for i in range(n) if i not in masked)
    assert changed >= 10  # of 15 masked rows: the masks did choose


def test_min_tokens_yields_to_a_complete_grammar(make_engine, smollm):
    """min_tokens bans the end while the grammar could go on; once it is complete, the grammar wins: "stop"."""
    tok = smollm.tokenizer
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                            structured=StructuredOutput("choice", json.dumps(CHOICES)))
    out = run_all(engine, [(tok.encode("Answer:"), params, None)])[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop" and len(out.token_ids) < 10


def test_objects_without_additional_properties_are_closed():
    """closed_objects: each object schema listing properties, wherever it sits (nested, in items, anyOf, $defs), gets
    additionalProperties false unless it says otherwise; a schema composing objects is left as written."""
    from frontend.engine.grammar import closed_objects

    age = {"type": "integer"}
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": age}},
                                               "l": {"type": "array", "items": {"properties": {"c": age}}},
                                               "u": {"anyOf": [{"properties": {"f": age}}, {"type": "null"}]}},
              "$defs": {"d": {"properties": {"e": age}}}}
    assert closed_objects(schema) == {
        "type": "object", "additionalProperties": False,
        "properties": {"a": {"type": "object", "properties": {"b": age}, "additionalProperties": False},
                       "l": {"type": "array", "items": {"properties": {"c": age}, "additionalProperties": False}},
                       "u": {"anyOf": [{"properties": {"f": age}, "additionalProperties": False}, {"type": "null"}]}},
        "$defs": {"d": {"properties": {"e": age}, "additionalProperties": False}}}
    for kept in ({"properties": {"a": age}, "additionalProperties": True},
                 {"properties": {"a": age}, "additionalProperties": age},
                 {"properties": {"a": age}, "patternProperties": {"^x": age}},
                 {"properties": {"a": age}, "required": ["a", "b"]},  # b: any value, but there
                 {"type": "object"}, {"type": "array", "items": False},
                 {"allOf": [{"properties": {"a": age}}, {"properties": {"b": age}}]},
                 {"properties": {"n": {"allOf": [{"properties": {"a": age}}]}}},
                 {"$ref": "#/$defs/p", "properties": {"b": age}, "$defs": {"p": {"properties": {"a": age}}}},
                 {"properties": {"k": age}, "if": {"properties": {"k": {"const": 1}}}, "then": {
                     "properties": {"x": age}, "required": ["x"]}}):
        assert closed_objects(kept) == kept
    assert schema == {**schema} and "additionalProperties" not in schema  # the caller's schema is not changed


def test_open_schemas_give_their_keys_alone_on_a_random_model(chat_model):
    """On random weights a key the schema does not list is as likely as one it does, so the mask alone keeps the
    output to the listed keys: every sample of an object schema that says nothing of other keys has exactly its
    properties (as vLLM's xgrammar and llama.cpp give them), one that says `additionalProperties` (an integer) takes
    others in some samples, and allOf's parts combine (neither part closed against the other)."""
    import jsonschema

    from backends.mlx.backend import MLXBackend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    INT = {"type": "integer", "minimum": 0, "maximum": 9}
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": INT},
              "required": ["name", "age"]}
    nested = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"q": INT}, "required": ["q"]}}}, "required": ["items"]}
    open_ = {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": INT,
             "maxProperties": 2}
    both = {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                      {"properties": {"b": INT}, "required": ["b"]}], "maxProperties": 2}
    engine = LLMEngine(MLXBackend(chat_model, progress=False),
                       EngineConfig(num_kv_blocks=512, block_size=16, scheduler=SchedulerConfig(max_num_seqs=32)))
    ask = chat_model.tokenizer.encode("Describe a thing in JSON.")
    jobs = [(ask, SamplingParams(temperature=1.0, seed=i, max_tokens=200, n=8,
                                 structured=StructuredOutput("json_schema", json.dumps(s))), s)
            for i, s in enumerate((person, nested, open_, both))]
    outs = run_all(engine, jobs)
    values = []
    for out, (_, _, schema) in zip(outs, jobs, strict=True):
        assert out.error is None, out.error
        done = [c for c in out.outputs if c.finish_reason == "stop"]
        # an open object's other keys are any strings, which random weights may not end within max_tokens
        assert schema is open_ or len(done) == len(out.outputs), [(c.finish_reason, c.text) for c in out.outputs]
        values.append([json.loads(c.text) for c in done])
        for v in values[-1]:
            jsonschema.validate(v, schema)
    assert all(set(v) == {"name", "age"} for v in values[0]), values[0]
    assert all(set(v) == {"items"} and all(set(i) == {"q"} for i in v["items"]) for v in values[1]), values[1]
    # the open one: a second key in some sample (a comma: "a" is one digit), finished or not
    assert any("," in c.text for c in outs[2].outputs), [c.text for c in outs[2].outputs]
    assert all(set(v) == {"a", "b"} for v in values[3]), values[3]
