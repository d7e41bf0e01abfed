"""The engine in its own process, as a client meets it: a real server (the default SmolLM2 GGUF on MLX) driven by the
official openai client. A step that fails in the engine process fails that step's requests (500) and the engine goes
on; a storm of clients that hang up frees every KV block there; a killed engine process fails every stream at once,
/health says 503, and the server restarts the engine (--on-engine-death restart) or exits non-zero (the default)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.serving import FRANCE, MODEL, ServerProcess

LONG = dict(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=1.0, extra_body={"ignore_eos": True})


def engine_pids(server: ServerProcess) -> list[int]:
    return [int(p) for p in re.findall(r"engine process ready \(pid (\d+)\)", server.log())]


def health(server: ServerProcess) -> int:
    try:
        with urllib.request.urlopen(server.base + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0  # not listening (any more)


def await_health(server: ServerProcess, status: int, within_s: float, what: str, poll_s: float = 0.1) -> None:
    """Polls /health until it answers `status`; fails with `what` and the log's tail past `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while health(server) != status:
        assert time.monotonic() < deadline, what + "\n" + server.log()[-3000:]
        time.sleep(poll_s)


def maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.05)


def idle(server: ServerProcess) -> dict[str, float]:
    """Waits until nothing runs or waits; the metrics then (the engine process's own numbers)."""
    for _ in range(600):
        m = server.metrics()
        if m["llm_engine:num_requests_running"] == m["llm_engine:num_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the engine never went idle: {m}")


async def streams_in_flight(client: openai.AsyncOpenAI, count: int):
    """`count` long streams, each past its first chunk: (their tasks, the chunk counts so far)."""
    got = [0] * count

    async def one(i: int) -> int:
        stream = await client.completions.create(**LONG, stream=True, seed=i)
        async for _ in stream:
            got[i] += 1
        return got[i]

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    await until(lambda: all(got), 120, "every stream's first chunk")
    return tasks, got


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """A server whose engine process fails one step on demand (tests/fault_server.py), and is restarted if it dies."""
    trigger = tmp_path_factory.mktemp("fault") / "fail-next-step"
    with ServerProcess("--max-num-seqs", "8", "--on-engine-death", "restart", module="tests.fault_server",
                       env={"FAULT_TRIGGER": str(trigger)}) as s:
        s.trigger = trigger
        yield s


def test_the_weights_are_in_the_engine_process_alone(faulty):
    api, engine = faulty.proc.pid, engine_pids(faulty)[-1]
    assert "libmlx" not in maps(api)  # the API process holds no backend, so no weights
    assert "libmlx" in maps(engine)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(faulty):
    client = openai.AsyncOpenAI(base_url=faulty.url, api_key="unused", max_retries=0, timeout=120)

    async def run():
        tasks, _ = await streams_in_flight(client, 2)
        whole = asyncio.create_task(client.completions.create(**LONG))
        await asyncio.sleep(0.5)  # the non-streaming one is in the batch too
        faulty.trigger.touch()
        done = await asyncio.wait_for(asyncio.gather(*tasks, whole, return_exceptions=True), 60)
        return done, await client.completions.create(model=MODEL, prompt="The capital of France is",
                                                     max_tokens=4, temperature=0)

    (first, second, whole), after = asyncio.run(run())
    for err in (first, second):
        assert isinstance(err, openai.APIError) and "device lost" in err.message, err
    assert isinstance(whole, openai.InternalServerError) and "device lost" in whole.message, whole
    assert after.choices[0].text and not faulty.trigger.exists()
    m = idle(faulty)
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]
    assert len(engine_pids(faulty)) == 1  # the engine went on: not restarted


def test_a_disconnect_storm_frees_every_block_in_the_engine_process(faulty):
    """24 streams (3x --max-num-seqs) hang up after their first chunk: the engine process aborts each one."""
    async def storm() -> None:
        async def one(i: int) -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", faulty.port)
            body = (f'{{"model": "{MODEL}", "prompt": "Story {i}:", "max_tokens": 300, "stream": true, '
                    '"ignore_eos": true}').encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            while not (await reader.readline()).startswith(b"data: "):
                pass
            writer.transport.abort()  # a reset, not a polite close

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), 300)

    asyncio.run(storm())
    m = idle(faulty)
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]
    assert m["llm_engine:kv_cache_usage_perc"] == 0
    assert faulty.log().count("aborted: its client went away") >= 24


def test_a_killed_engine_is_restarted(faulty):
    client = openai.AsyncOpenAI(base_url=faulty.url, api_key="unused", max_retries=0, timeout=120)
    pid = engine_pids(faulty)[-1]

    async def run():
        tasks, _ = await streams_in_flight(client, 3)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        failed_in = time.monotonic() - start
        status = health(faulty)  # the new engine is still loading: seconds
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        return done, failed_in, status, refused.value

    done, failed_in, status, refused = asyncio.run(run())
    for err in done:
        assert isinstance(err, openai.APIError) and "SIGKILL" in err.message, err
    assert failed_in < 10, f"the streams took {failed_in:.1f} s to fail"
    assert status == 503 and refused.status_code == 503
    await_health(faulty, 200, 180, "the engine was not restarted", poll_s=0.2)
    assert len(engine_pids(faulty)) == 2 and "engine process restarted" in faulty.log()
    sync = openai.OpenAI(base_url=faulty.url, api_key="unused", max_retries=0, timeout=120)
    r = sync.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    m = idle(faulty)
    assert m["llm_engine:num_kv_blocks_free"] == m["llm_engine:num_kv_blocks_total"]


def test_a_killed_engine_ends_the_server_with_an_error_by_default():
    with ServerProcess("--max-num-seqs", "4") as server:
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

        async def run():
            tasks, _ = await streams_in_flight(client, 3)
            os.kill(engine_pids(server)[-1], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

        done = asyncio.run(run())
        for err in done:
            assert isinstance(err, openai.APIError) and "SIGKILL" in err.message, err
        assert server.proc.wait(timeout=30) == 1
        assert "the server exits: its engine is gone" in server.log()
