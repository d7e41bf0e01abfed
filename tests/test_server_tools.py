"""Tools and reasoning through the real server with the official openai client: a tiny random Qwen3 whose template
takes tools and opens <think> in the prompt (so every token it writes is reasoning). SmolLM2, whose template has
no tools, takes them too: tests/test_server.py."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serving import ServerProcess, post
from tests.tiny_hf import save_tiny_chat_qwen3
from tests.tool_templates import QWEN_TOOLS, TOOL_HISTORY, WEATHER_TOOL

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def ok(server, path: str, body: dict) -> dict:
    """The JSON body of a POST that must succeed."""
    status, got = post(server, path, body)
    assert status == 200, got
    return got


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_path):
    folder = tmp_path_factory.mktemp("tiny-tools")
    save_tiny_chat_qwen3(folder, smollm_path)
    for name, extra in (("tokenizer_config.json", {"chat_template": QWEN_TOOLS}),
                        ("config.json", {"max_position_embeddings": 512})):  # room for the tool history's prompt
        cfg = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**cfg, **extra}))
    with ServerProcess("--w", str(folder), "--max-gen-tokens", "8", "--mem", "32", "--engine-in-process") as s:
        s.folder = folder
        yield s


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=tiny.url, api_key="unused", max_retries=0, timeout=60)


def plain_text(server, messages: list[dict], max_tokens: int, **kw) -> str:
    """The same prompt's greedy output through /v1/completions, where nothing is parsed: the reference."""
    ids = ok(server, "/tokenize", {"messages": messages, **kw})["tokens"]
    return ok(server, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0})["choices"][0][
        "text"]


def test_reasoning_split_sync_and_streamed(tiny, client):
    expected = plain_text(tiny, USER, 6)
    assert expected and "</think>" not in expected
    r = client.chat.completions.create(model=None, messages=USER, max_tokens=6, temperature=0)
    msg = r.choices[0].message
    assert msg.reasoning_content == expected and not msg.content
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=None, messages=USER, max_tokens=6, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == expected
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_each_streamed_choice_has_its_own_reasoning(client):
    kw = dict(model=None, messages=USER, max_tokens=5, temperature=1, seed=11, n=2)
    whole = client.chat.completions.create(**kw)
    got = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            got[c.index] += getattr(c.delta, "reasoning_content", None) or ""
    assert got == [c.message.reasoning_content for c in whole.choices] and got[0] != got[1]


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}},
                                   {"reasoning_effort": "none"}])
def test_thinking_off_gives_content(tiny, client, extra):
    expected = plain_text(tiny, USER, 6, chat_template_kwargs={"enable_thinking": False})
    r = client.chat.completions.create(model=None, messages=USER, max_tokens=6, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == expected
    assert r.choices[0].message.reasoning_content is None


def test_tools_and_tool_history_reach_the_template(tiny, client):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny.folder)
    history = json.loads(json.dumps(TOOL_HISTORY))
    for m in history:  # transformers wants the arguments as a dict
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    # text, not ids: transformers 5 splits this tokenizer.json's newlines otherwise than the tokenizers library does
    want = ref.apply_chat_template(history, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    got = ok(tiny, "/tokenize", {"messages": TOOL_HISTORY, "tools": [WEATHER_TOOL]})["tokens"]
    assert ok(tiny, "/detokenize", {"tokens": got})["prompt"] == want
    assert '"arguments": {"city": "Rome"}' in want and '"name": "get_weather"' in want
    r = client.chat.completions.create(model=None, messages=TOOL_HISTORY, tools=[WEATHER_TOOL], max_tokens=4,
                                       tool_choice="auto", n=2, temperature=1, seed=3)
    assert r.usage.prompt_tokens == len(got) and len(r.choices) == 2


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.0.function.name"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools.0.type"),
    ([WEATHER_TOOL], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
])
def test_bad_tools_are_400s(client, tools, choice, param):
    kw = {"tool_choice": choice} if choice else {}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, messages=USER, tools=tools, max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body


UNIT_TOOL = {"type": "function", "function": {
    "name": "set_unit", "description": "Set the temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                   "additionalProperties": False}}}


def _check_call(call, name: str, tools: list[dict]) -> dict:
    """A call's name, its id and type, and its arguments valid against that tool's schema."""
    import jsonschema

    assert call.type == "function" and call.id and call.function.name == name
    args = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(args, schema)
    return args


def round_trip(client, messages: list[dict], tools: list[dict], choice, name: str | None, seed: int) -> None:
    """A forced tool call (sync, then streamed with the same seed: the same call), its answer sent back as a tool
    message, and the model's next turn in free text. On random weights only the token mask makes the call valid."""
    kw = dict(model=None, messages=messages, tools=tools, tool_choice=choice, max_tokens=100, temperature=1,
              seed=seed, parallel_tool_calls=False)  # required: one call, then the array must close
    r = client.chat.completions.create(**kw)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "tool_calls" and not msg.content and msg.tool_calls
    call = msg.tool_calls[0]
    name = name or call.function.name
    args = _check_call(call, name, tools)
    pieces: dict[int, dict] = {}
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = pieces.setdefault(tc.index, {"name": "", "arguments": ""})
            got["name"] += tc.function.name or "" if tc.function else ""
            got["arguments"] += tc.function.arguments or "" if tc.function else ""
    assert pieces[0]["name"] == name and json.loads(pieces[0]["arguments"]) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    after = client.chat.completions.create(model=None, messages=history, tools=tools, tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason == "length" and not after.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_forced_tool_call_round_trip(client, choice):
    tools = [WEATHER_TOOL, UNIT_TOOL]
    round_trip(client, USER, tools, choice, None if choice == "required" else "set_unit", seed=3)


def test_forced_tool_call_async(tiny):
    import asyncio

    async def main():
        aclient = openai.AsyncOpenAI(base_url=tiny.url, api_key="unused", max_retries=0, timeout=60)
        r = await aclient.chat.completions.create(
            model=None, messages=USER, tools=[UNIT_TOOL], tool_choice="required", parallel_tool_calls=False,
            max_tokens=100, temperature=0)
        await aclient.close()
        return r

    r = asyncio.run(main())
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0], "set_unit", [UNIT_TOOL])


def test_tool_choice_and_response_format_together_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="at most one structured-output constraint"):
        client.chat.completions.create(model=None, messages=USER, tools=[UNIT_TOOL], tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=8)

