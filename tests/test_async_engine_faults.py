"""The engine thread under faults: a failing metrics hook, a malformed add, a backend that raises mid-step, and a
thread that dies: no handler waits forever, and /health says 503 once the engine is gone. SmolLM2 on MLX."""

from __future__ import annotations

import asyncio
import json

import pytest

from core.sampling_params import SamplingParams
from frontend.async_engine import AsyncEngine, EngineDeadError, StepFailedError

PROMPT = [1, 504, 3575, 282, 4649, 314]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt=PROMPT, params=PARAMS, timeout: float = 60) -> list[int]:
    async def run():
        last = None
        async for out in engine.generate(prompt, params):
            last = out
        return last.outputs[0].token_ids
    return await asyncio.wait_for(run(), timeout)


@pytest.fixture
def async_engine(make_engine):
    engines = []

    def make(**kw):
        engine = AsyncEngine(make_engine(**kw))
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.shutdown()


def test_a_failing_hook_and_a_malformed_add_do_not_stop_the_engine(async_engine):
    engine = async_engine()
    engine.on_step = lambda: 1 / 0

    async def run():
        want = await collect(engine)
        with pytest.raises(RuntimeError, match="could not add"):
            await collect(engine, prompt=[None, 3])  # int(None) raises TypeError on the engine thread
        return want, await collect(engine)

    want, again = asyncio.run(run())
    assert len(want) == 6 and again == want and engine.alive


def test_a_backend_that_raises_mid_step_fails_its_requests_and_the_engine_goes_on(async_engine):
    engine = async_engine()
    forward, calls = engine.engine.backend.forward, []

    def flaky(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return forward(batch)

    async def run():
        want = await collect(engine)
        calls.clear()
        engine.engine.backend.forward = flaky
        try:
            with pytest.raises(StepFailedError, match="device lost"):
                await asyncio.gather(collect(engine), collect(engine, prompt=PROMPT[:4]))
        finally:
            engine.engine.backend.forward = forward
        return want, await collect(engine)

    want, again = asyncio.run(run())
    assert again == want and engine.alive
    assert engine.engine.num_running() == 0 and engine.engine.all_blocks_free()


def test_a_dead_engine_thread_fails_waiting_handlers_and_health_says_503(async_engine, smollm):
    from frontend.metrics import Metrics
    from frontend.protocol import ServerDefaults
    from frontend.server import build_app
    from frontend.serving import OpenAIServing, ServedModel

    engine = async_engine()

    class Fatal(BaseException):  # not an Exception: the step loop's own handler lets it through
        pass

    def fatal_step():
        raise Fatal("out of the blue")

    engine.engine.step = fatal_step
    serving = OpenAIServing(engine, Metrics(engine.stats, "m"), smollm.tokenizer,
                            ServedModel("m", 8192, 49152, 0), ServerDefaults(), 16)
    app = build_app(serving, name="dead_engine_test")
    health = next(r.handler for r in app.router.routes if r.path == "health")

    async def run():
        with pytest.raises(EngineDeadError, match="died.*out of the blue"):
            await collect(engine, timeout=30)
        with pytest.raises(EngineDeadError):  # refused at once, not queued to nobody
            await collect(engine, timeout=5)
        return await health(None)

    response = asyncio.run(run())
    assert not engine.alive
    assert response.status == 503
    err = json.loads(response.body)["error"]
    assert err["code"] == "engine_dead" and "out of the blue" in err["message"]


def test_a_fatal_backend_error_ends_the_engine(async_engine, monkeypatch):
    """A step error the backend calls fatal (CUDA: a poisoned context, which CUDABackend.is_fatal probes) ends the
    engine at once: its request and every later one get EngineDeadError, and the engine is no longer alive (/health
    503), instead of every later step failing one by one."""
    engine = async_engine()
    backend = engine.engine.backend

    class DeviceGone(RuntimeError):
        pass

    def broken(batch):
        raise DeviceGone("an illegal memory access was encountered")

    monkeypatch.setattr(backend, "forward", broken)
    monkeypatch.setattr(backend, "is_fatal", lambda e: isinstance(e, DeviceGone))

    async def run():
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            await collect(engine)
        with pytest.raises(EngineDeadError):
            await collect(engine)

    asyncio.run(run())
    assert not engine.alive
