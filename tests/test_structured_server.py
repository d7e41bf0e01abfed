"""Structured outputs through the real server with the official openai client: response_format json_schema (plain,
streamed, n=2), json_object, vLLM's structured_outputs and guided_* fields, and 400s naming a bad constraint."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.serving import ServerProcess
from tests.structured_cases import CHOICES, REGEX, SCHEMAS, check_json

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person in JSON."}]
PERSON = SCHEMAS[0]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "8", "--max-gen-tokens", "96") as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_json_schema_with_n_2(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, n=2, temperature=1.0,
                                       seed=3, max_tokens=80)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        check_json(c.message.content, PERSON)


def test_json_schema_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, stream=True,
                                            temperature=1.0, seed=4, max_tokens=80)
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    check_json(text, PERSON)


def test_json_object_and_vllm_fields(client):
    short = [{"role": "user", "content": 'Reply with the JSON {"ok": true} and nothing else.'}]
    r = client.chat.completions.create(model=MODEL, messages=short, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Shall we?", max_tokens=10, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Plate:", max_tokens=12, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
])
def test_bad_constraints_get_400(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    err = e.value.body
    assert err["param"] == param and words in err["message"] and "Traceback" not in err["message"], err


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": FORMAT}, "json_schema"),
    ({"structured_outputs": {"json": PERSON}}, "json_schema"),
    ({"structured_outputs": {"json": json.dumps(PERSON), "disable_fallback": True}}, "json_schema"),
    ({"structured_outputs": {"json_object": True}}, "json_object"),
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a" [0-9]+'}}, "grammar"),  # GBNF, translated to Lark
    ({"guided_json": PERSON}, "json_schema"),
    ({"guided_choice": CHOICES}, "choice"),
    ({"guided_grammar": 'start: "x"'}, "grammar"),
])
def test_request_fields_map_onto_one_constraint(fields, kind):
    """Each field, on chat and completion requests alike, becomes the StructuredOutput the engine enforces."""
    from frontend.protocol import ChatCompletionRequest, CompletionRequest
    from frontend.structured_request import request_constraint

    for req in (ChatCompletionRequest(messages=ASK, **fields), CompletionRequest(prompt="x", **fields)):
        so = request_constraint(req)
        assert (so and so.kind) == kind
        if kind == "json_schema":
            assert json.loads(so.spec) == PERSON
        if kind == "choice":
            assert json.loads(so.spec) == CHOICES


def test_smollm_tool_call_round_trip(client):
    """SmolLM2 (its template writes no tools): a named tool forced by the mask, the answer sent back, a reply."""
    from tests.test_server_tools import UNIT_TOOL, round_trip

    messages = [{"role": "user", "content": "Use Fahrenheit, please."}]
    round_trip(client, messages, [UNIT_TOOL], {"type": "function", "function": {"name": "set_unit"}}, "set_unit",
               seed=5)
