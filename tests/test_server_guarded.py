"""The second server of the serving tests: an API key, one sequence at a time, at most one waiting request, a log
file and a tiny KV cache, with its engine in the server's process (401s, the cache's bound on max_tokens, 429s)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest

from tests.serving import FRANCE, MODEL, ServerProcess, assert_error_body, post


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A second server: an API key, one sequence at a time, at most one waiting request, a log file, and a KV
    cache (16 MiB: 352 tokens) far smaller than the context. Its engine runs in a thread of the server's process
    (--engine-in-process), so that mode is served end to end too."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess("--api-key", "sesame", "--max-num-seqs", "1", "--max-waiting", "1", "--log", str(log),
                       "--mem", "16", "--engine-in-process") as s:
        s.log_file_path = log
        yield s


def test_api_key(guarded):
    wrong = openai.OpenAI(base_url=guarded.url, api_key="open-up", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, body = post(guarded, "/v1/chat/completions", {"messages": FRANCE})  # no header at all
    assert status == 401 and assert_error_body(body)
    right = openai.OpenAI(base_url=guarded.url, api_key="sesame", max_retries=0)
    assert right.models.list().data[0].id == MODEL
    with urllib.request.urlopen(guarded.base + "/health") as r:  # probes need no key
        assert r.status == 200


def test_small_kv_cache_bounds_the_default_max_tokens(guarded):
    client = openai.OpenAI(base_url=guarded.url, api_key="sesame", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)  # no max_tokens
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:  # within the context, beyond what the cache can ever hold
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1000)
    assert "KV cache holds 352 tokens" in e.value.body["message"]


def test_429_when_too_many_wait(guarded):
    client = openai.AsyncOpenAI(base_url=guarded.url, api_key="sesame", max_retries=0, timeout=120)
    long = dict(model=MODEL, messages=FRANCE, max_tokens=300, extra_body={"ignore_eos": True})

    async def wait_for(name: str, value: float) -> None:
        for _ in range(600):
            if guarded.metrics()[name] == value:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{name} never reached {value}")

    async def run():
        running = asyncio.create_task(client.chat.completions.create(**long))
        await wait_for("llm_engine:num_requests_running", 1)
        waiting = asyncio.create_task(client.chat.completions.create(**long))
        await wait_for("llm_engine:num_requests_waiting", 1)
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4)
        running.cancel()
        waiting.cancel()
        await asyncio.gather(running, waiting, return_exceptions=True)
        return e.value

    err = asyncio.run(run())
    assert err.status_code == 429 and "waiting" in err.body["message"]
    for _ in range(200):  # the cancelled clients' requests are aborted: the server is idle again
        m = guarded.metrics()
        if m["llm_engine:num_requests_running"] == m["llm_engine:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]
    assert m["llm_engine:request_success_total"] >= 2  # the two cancelled requests count, as aborts
    logged = guarded.log_file_path.read_text()
    assert "aborted: its client went away" in logged and "/v1/chat/completions 429" in logged
