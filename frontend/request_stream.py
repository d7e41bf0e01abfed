"""generate() as handlers see it, shared by the engine's two front-ends (AsyncEngine's thread in this process,
EngineClient's engine process): a request's outputs are awaited from its queue until the finished one, an exception
put there is raised, and a handler that leaves early (a disconnect, a cancellation) aborts the request, so that its
KV blocks are freed. Each front-end only says how a request is handed over and how it is abandoned.

Under load a handler can fall behind its request (hundreds of streams, each chunk a send on one event loop): then
the reports waiting in its queue go out as one (their deltas joined, as vLLM's output collector does), so a slow
loop sends fewer, larger chunks instead of falling further behind. A lone stream never does: every token keeps its
chunk there."""

from __future__ import annotations

import asyncio
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from core.sampling_params import SamplingParams
from frontend.engine.engine import RequestOutput
from frontend.engine.outputs import merge_outputs

Queue = asyncio.Queue  # of RequestOutput | BaseException
# With more streams than this, a handler that fell behind joins its waiting reports. 256 streams on an H200: 0.83 ->
# 0.91 of the offline engine; LLM_ENGINE_COALESCE_STREAMS moves it (a benchmark's A/B of inter-token latency).
COALESCE_STREAMS = int(os.environ.get("LLM_ENGINE_COALESCE_STREAMS", "16"))


class RequestStreams(ABC):
    active: int  # generate() calls not yet returned; set to 0 by the subclass

    @abstractmethod
    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> Queue:
        """Hands the request over (or raises, e.g. EngineDeadError); returns the queue its outputs arrive on."""

    @abstractmethod
    def _abandon(self, request_id: str) -> None:
        """The handler left before the finished output: abort the request."""

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they come; leaving early (or being cancelled) aborts it."""
        request_id = request_id or uuid.uuid4().hex
        queue = self._submit(request_id, prompt, params)
        self.active += 1
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                failure = None
                while self.active > COALESCE_STREAMS and not item.finished and not queue.empty():
                    more = queue.get_nowait()
                    if isinstance(more, BaseException):
                        failure = more  # raised after what came before it is handed out
                        break
                    item = merge_outputs(item, more)
                finished = item.finished
                yield item
                if failure is not None:
                    raise failure
                if finished:
                    return
        finally:
            self.active -= 1
            if not finished:
                self._abandon(request_id)
