"""The server's bounds and OpenAI's request rules, as a client meets them: a real server with small limits, each
broken by one request that gets a 400 (413, 429) naming the limit, and hostile bodies that never get a 5xx."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from tests.serving import FRANCE, MODEL, ServerProcess, assert_error_body, post

LIMITS = {"--max-request-bytes": 65536, "--max-stop": 4, "--max-stop-chars": 32, "--max-n": 4, "--max-prompts": 3,
          "--max-request-seqs": 6, "--max-logit-bias": 4, "--max-messages": 5, "--max-prompt-chars": 2000,
          "--max-waiting": 2, "--max-waiting-seqs": 6}


@pytest.fixture(scope="module")
def bounded():
    args = [str(x) for kv in LIMITS.items() for x in kv]
    with ServerProcess("--max-num-seqs", "1", "--max-gen-tokens", "8", *args) as s:
        yield s


def chat(**kw) -> dict:
    return {"messages": FRANCE, "max_tokens": 2, **kw}


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", chat(stop=list("abcde")), "stop", "at most 4"),
    ("/v1/completions", {"prompt": "x", "stop": "y" * 33}, "stop", "at most 32"),
    ("/v1/chat/completions", chat(n=5), "n", "at most 4"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "at most 3"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4], [5, 6]], "n": 3}, "prompt", "at most 6"),
    ("/v1/chat/completions", chat(logit_bias={str(i): 1 for i in range(5)}), "logit_bias", "at most 4"),
    ("/v1/chat/completions", {"messages": FRANCE * 6}, "messages", "at most 5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2001}]}, "messages", "2000"),
    ("/v1/completions", {"prompt": "x" * 2001}, "prompt", "at most 2000"),
    ("/tokenize", {"prompt": "x" * 2001}, "prompt", "at most 2000"),
    ("/v1/chat/completions", chat(max_tokens=10**30), "max_tokens", "8192"),
    ("/v1/chat/completions", chat(logit_bias={"²": 5}), "logit_bias", "token ids"),  # isdigit() but not int()
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs", "logprobs"),
    ("/v1/chat/completions", chat(stream_options={"include_usage": True}), "stream_options", "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
])
def test_each_bound_is_a_400_naming_it(bounded, path, body, param, words):
    status, got = post(bounded, path, body)
    assert status == 400, got
    assert words in assert_error_body(got, param)


def test_a_body_past_the_limit_is_413_before_any_work(bounded):
    start = time.monotonic()
    status, got = post(bounded, "/v1/completions", {"prompt": "word " * 20_000})  # 100 kB
    assert status == 413 and assert_error_body(got)
    assert time.monotonic() - start < 5
    status, _ = post(bounded, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200


@pytest.mark.parametrize("body", [
    b'{"prompt": "\xff\xfe broken utf-8"}', b'{"prompt": "lone \\ud800 surrogate", "max_tokens": 1}',
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "max_tokens": 1, "temperature": 1e309}',
    b'{"prompt": "x", "top_p": 1e309}', b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
])
def test_hostile_bodies_never_get_a_5xx(bounded, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, got = post(bounded, path, body)
    assert status in (200, 400), got
    if status == 400:
        assert_error_body(got)


def test_429_counts_requests_and_sequences_apart(bounded):
    client = openai.AsyncOpenAI(base_url=bounded.url, api_key="unused", max_retries=0, timeout=120)
    long = dict(model=MODEL, prompt="Once upon a time", max_tokens=200, extra_body={"ignore_eos": True})

    async def wait_for(name: str, value: float) -> None:
        for _ in range(600):
            if bounded.metrics()[name] == value:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{name} never reached {value}")

    async def idle() -> None:  # the cancelled clients' requests are aborted
        await wait_for("llm_engine:num_requests_running", 0)
        await wait_for("llm_engine:num_requests_waiting", 0)

    async def run():
        running = asyncio.create_task(client.completions.create(**long))
        await wait_for("llm_engine:num_requests_running", 1)
        # One request of n=4 waits: four sequences, one request (the limit of 2 requests still admits another).
        many = asyncio.create_task(client.completions.create(**long, n=4))
        await wait_for("llm_engine:num_requests_waiting", 4)
        second = asyncio.create_task(client.completions.create(**{**long, "max_tokens": 2}))
        await wait_for("llm_engine:num_requests_waiting", 5)
        with pytest.raises(openai.RateLimitError) as requests_full:  # a third waiting request
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        await wait_for("llm_engine:num_requests_waiting", 4)
        with pytest.raises(openai.RateLimitError) as seqs_full:  # 4 + 3 sequences > 6 (2 requests are fine)
            await client.completions.create(model=MODEL, prompt=[1, 2], n=3, max_tokens=2)
        for t in (running, many):
            t.cancel()
        await asyncio.gather(running, many, return_exceptions=True)
        await idle()
        return requests_full.value, seqs_full.value

    by_requests, by_seqs = asyncio.run(run())
    assert "2 requests are waiting (limit 2)" in by_requests.body["message"]
    assert "4 sequences are waiting and this request adds 3 (limit 6)" in by_seqs.body["message"]
    for _ in range(200):
        m = bounded.metrics()
        if m["llm_engine:num_requests_running"] == m["llm_engine:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]


def test_health_is_ok_while_the_engine_runs(bounded):
    import urllib.request
    with urllib.request.urlopen(bounded.base + "/health") as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


def test_ten_times_max_num_seqs_streams_complete_or_get_429(bounded):
    """10 streams against one running sequence and two waiting: each ends (done, or 429), none hangs, and the
    server is idle with every block free afterwards."""
    client = openai.AsyncOpenAI(base_url=bounded.url, api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> str:
        try:
            stream = await client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=4, stream=True,
                                                     extra_body={"ignore_eos": True})
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            return "done" if text else "empty"
        except openai.RateLimitError:
            return "429"

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(10))), 120)

    got = asyncio.run(run())
    assert set(got) <= {"done", "429"} and "done" in got, got
    for _ in range(200):
        m = bounded.metrics()
        if m["llm_engine:num_requests_running"] == m["llm_engine:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    assert m["llm_engine:num_requests_running"] == m["llm_engine:num_requests_waiting"] == 0
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]
