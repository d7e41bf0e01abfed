"""The OpenAI-compatible server, as a client meets it: a real `python -m frontend` process serving the
default SmolLM2 GGUF on a loopback port, driven with the official openai client (sync and async)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.serving import FRANCE, MODEL, ServerProcess, assert_error_body, post, readme_blocks


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "48", "--max-gen-tokens", "64") as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "llm-engine"
    assert card.model_extra["max_model_len"] == 8192
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    with urllib.request.urlopen(server.base + "/health") as r:
        assert r.status == 200


def test_greedy_chat_answers_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 37  # the same ids transformers' chat template gives (test_smollm_reference)
    assert r.usage.completion_tokens >= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_tools_are_taken_and_change_nothing_without_template_support(client):
    """SmolLM2's template has no tools and no tool-call markers: the prompt, and so the greedy answer, stay the same
    with tool_choice auto (whole) and none (streamed)."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    kw = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=6)
    plain = client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw, tools=[weather], tool_choice="auto")
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens == plain.usage.prompt_tokens == 37
    stream = client.chat.completions.create(**kw, tools=[weather], tool_choice="none", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].message.content


def test_stream_equals_non_stream_and_usage_chunk(aclient):
    async def run():
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], temperature=0,
                  max_tokens=20)
        whole = await aclient.chat.completions.create(**kw)
        stream = await aclient.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        return whole, [c async for c in stream]

    whole, chunks = asyncio.run(run())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_a_list_of_prompts(client):
    prompts = ["The capital of France is", "One, two, three,"]
    both = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8)
    assert sorted(c.index for c in both.choices) == [0, 1]
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8)
        assert both.choices[i].text == alone.choices[0].text
    assert both.usage.completion_tokens == 16
    ids = client.completions.create(model=MODEL, prompt=[[504, 3575, 282, 4649, 314]], temperature=0, max_tokens=4)
    assert ids.usage.prompt_tokens == 5 and ids.choices[0].text


def test_streamed_completions_with_echo(client):
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=6,
                                            stream=True, echo=True))
    whole = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=6)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "One, two, three," + whole.choices[0].text


def test_a_token_whose_text_is_held_back_still_streams_a_chunk(client):
    """Token 111 alone is an incomplete UTF-8 character, its text held back until the end: each token still gets a
    chunk of its own (empty text), so a client's inter-token gaps are one step each, and the text adds up."""
    kw = dict(model=MODEL, temperature=0, max_tokens=4, logit_bias={"111": 100})
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    text = list(client.completions.create(prompt="Hi", **kw, **usage))
    chat = list(client.chat.completions.create(messages=FRANCE, **kw, **usage))
    assert text[-1].usage.completion_tokens == chat[-1].usage.completion_tokens == 4
    assert len(text) - 1 == 4  # the last chunk: usage only
    assert [c.choices[0].delta.role for c in chat[:-1]] == ["assistant"] + [None] * 4
    whole = client.completions.create(prompt="Hi", **kw)
    assert "".join(c.choices[0].text for c in text[:-1]) == whole.choices[0].text != ""
    assert [c.choices[0].text for c in text[:3]] == [""] * 3


def test_stop_strings(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    content = full.choices[0].message.content
    cut = content.index("Paris")
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24,
                                       stop=["Paris", "Lyon"])
    assert r.choices[0].message.content == content[:cut]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "Paris"
    chunks = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24,
                                            stop="Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content[:cut]


def test_n_2(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say a word."}], n=2,
                                       temperature=1.0, seed=7, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens >= 2
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say a word."}],
                                                 n=2, temperature=1.0, seed=7, max_tokens=12, stream=True))
    for i in (0, 1):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert streamed == r.choices[i].message.content  # same seed, same choices, streamed or not
        assert sum(c.choices[0].finish_reason is not None for c in chunks if c.choices[0].index == i) == 1


def test_logprobs(client):
    import math
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy picks the most likely token
        assert e.token == e.top_logprobs[0].token
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-6
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert "".join(e.token for e in entries[:-1]) in r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_seeded_request_is_the_same_with_others_in_flight(aclient):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about rain."}],
              temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)

    async def run():
        alone = await aclient.chat.completions.create(**kw)
        others = [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}],
                                                  temperature=0.5 + 0.1 * i, seed=i, max_tokens=30,
                                                  extra_body={"top_k": 5 + i})
                  for i in range(6)]
        together = await asyncio.gather(aclient.chat.completions.create(**kw), *others)
        return alone, together[0]

    alone, together = asyncio.run(run())
    assert together.choices[0].message.content == alone.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ('{"messages": [', None, "JSON"),
    ({"messages": FRANCE, "temperature": "hot"}, "temperature", "number"),
    ({"messages": FRANCE, "top_p": 2}, "top_p", "1"),
    ({"messages": FRANCE, "n": 0}, "n", "1"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "user"),
    ({"messages": FRANCE, "max_tokens": 9000}, "max_tokens", "8192"),
    ({"messages": FRANCE, "logit_bias": {"999999": 5}}, "logit_bias", "token ids"),
    ({"messages": FRANCE, "stop": 5}, "stop", "string"),
    ({"messages": FRANCE, "prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    ({"messages": FRANCE, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "cannot both be true"),
    ({"messages": [*FRANCE, {"role": "assistant", "content": " "}], "continue_final_message": True}, "messages",
     "no text to continue"),
    ([1, 2], None, "object"),
])
def test_bad_chat_requests_get_400(server, body, param, words):
    status, got = post(server, "/v1/chat/completions", body)
    assert status == 400
    assert words in assert_error_body(got, param)


def test_bad_completion_requests_get_400(server):
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": [70000]}, "prompt"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "logprobs": 50}, "logprobs"),
                        ({"prompt": "x " * 9000}, "prompt")]:
        status, got = post(server, "/v1/completions", body)
        assert status == 400, (body, got)
        message = assert_error_body(got, param)
        if body.get("prompt") == "x " * 9000:
            assert "8192" in message


def test_a_generation_model_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError, match="generates text and has no embeddings") as e:
        client.embeddings.create(model=MODEL, input="hello")
    assert e.value.body["param"] == "model"


def test_unknown_model_is_404_and_unknown_route_too(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=FRANCE)
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]
    status, body = post(server, "/v1/nothing", {})
    assert status == 404 and assert_error_body(body)


def test_tokenize_detokenize(server):
    status, tok = post(server, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == 2
    status, text = post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and text["prompt"] == "Hello world"
    status, chat = post(server, "/tokenize", {"messages": FRANCE})
    assert chat["count"] == 37
    status, body = post(server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and assert_error_body(body, "tokens")


def test_continue_final_message_prefills_the_reply(server, client):
    """vLLM's continue_final_message: the prompt ends inside the assistant's prefilled text (no end of turn), and the
    reply goes on from it, as a completion of that same prompt does (greedy, the same ids through /tokenize)."""
    chat = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    status, tok = post(server, "/tokenize", {"messages": chat, "continue_final_message": True,
                                             "add_generation_prompt": False})
    assert status == 200
    status, text = post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert text["prompt"].endswith("<|im_start|>assistant\nThe capital of France is")
    reply = client.chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=8,
                                           extra_body={"continue_final_message": True})
    same = client.completions.create(model=MODEL, prompt=tok["tokens"], temperature=0, max_tokens=8)
    assert reply.choices[0].message.content == same.choices[0].text and "Paris" in same.choices[0].text
    assert reply.usage.prompt_tokens == tok["count"]


def test_openapi_document(server):
    with urllib.request.urlopen(server.base + "/openapi.json") as r:
        doc = json.loads(r.read())
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize",
            "/detokenize"} <= set(doc["paths"])
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in schema["required"]
    top_p = schema["properties"]["top_p"]["anyOf"]
    assert {"type": "number", "exclusiveMinimum": 0, "maximum": 1} in top_p and {"type": "null"} in top_p


def test_abandoned_requests_free_their_blocks(server, client):
    """40 clients give up after 1.5 s (streaming and not); the engine aborts them all and frees every KV block."""
    async def abandon():
        # A streaming read times out only when no chunk comes for that long, so the deadline is the caller's.
        quick = openai.AsyncOpenAI(base_url=server.url, api_key="unused", timeout=1.5, max_retries=0)

        async def one(i: int) -> str:
            kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}],
                      max_tokens=500, temperature=1.0, seed=i, extra_body={"ignore_eos": True})

            async def run() -> None:
                if i % 2:
                    await quick.chat.completions.create(**kw)
                else:
                    async for _ in await quick.chat.completions.create(**kw, stream=True):
                        pass
            try:
                await asyncio.wait_for(run(), 1.5)
            except (TimeoutError, openai.APITimeoutError):
                return "timeout"
            return "finished"
        return await asyncio.gather(*(one(i) for i in range(40)))

    assert asyncio.run(abandon()) == ["timeout"] * 40
    start = time.monotonic()
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert time.monotonic() - start < 60, "a fresh request waited behind abandoned ones"
    m = server.metrics()
    assert m["llm_engine:num_requests_running"] == 0 and m["llm_engine:num_requests_waiting"] == 0
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]
    assert m["llm_engine:kv_cache_usage_perc"] == 0
    assert m["llm_engine:generation_tokens_total"] > 0 and m["llm_engine:time_to_first_token_seconds_count"] > 0


def test_readme_examples_work_verbatim(server):
    """The README's curl and openai examples, with only the port changed to this test server's."""
    here = f"127.0.0.1:{server.port}"
    curl = readme_blocks("sh", "curl").replace("127.0.0.1:2000", here)
    r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout)["choices"][0]["message"]["content"]
    code = readme_blocks("python", "from openai import OpenAI").replace("127.0.0.1:2000", here)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 10


def test_a_long_tokenization_does_not_stall_the_streams(server, aclient):
    """2 MB to tokenize (~2 s here): it runs off the event loop and releases the GIL, so a stream keeps flowing."""
    text = "word " * 400_000

    def tokenize() -> float:
        start = time.monotonic()
        status, body = post(server, "/tokenize", {"prompt": text})
        assert status == 200 and body["count"] == 400_001
        return time.monotonic() - start

    async def run():
        gaps, last = [], None
        stream = await aclient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64, stream=True,
                                                  extra_body={"ignore_eos": True})
        took = asyncio.create_task(asyncio.to_thread(tokenize))
        async for _ in stream:
            now = time.monotonic()
            if last is not None and not took.done():
                gaps.append(now - last)
            last = now
        return await took, gaps

    took, gaps = asyncio.run(run())
    assert gaps, "the stream ended before the tokenization began"
    assert max(gaps) < took / 2, f"a {max(gaps):.2f} s gap in the stream while tokenizing took {took:.2f} s"
