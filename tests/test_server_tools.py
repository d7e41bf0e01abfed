"""Tools and reasoning through the real server with the official openai client: a tiny random Qwen3 whose template
takes tools and opens <think> in the prompt (so every token it writes is reasoning). SmolLM2, whose template has
no tools, takes them too: tests/test_server.py."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.serving import ServerProcess
from tests.tiny_hf import save_tiny_chat_qwen3
from tests.tool_templates import QWEN_TOOLS, TOOL_HISTORY, WEATHER_TOOL

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


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
    ids = post(server, "/tokenize", {"messages": messages, **kw})["tokens"]
    return post(server, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0})["choices"][0][
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
    got = post(tiny, "/tokenize", {"messages": TOOL_HISTORY, "tools": [WEATHER_TOOL]})["tokens"]
    assert post(tiny, "/detokenize", {"tokens": got})["prompt"] == want
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
