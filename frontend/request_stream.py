"""generate() as handlers see it, shared by the engine's two front-ends (AsyncEngine's thread in this process,
EngineClient's engine process): a request's outputs are awaited from its queue until the finished one, an exception
put there is raised, and a handler that leaves early (a disconnect, a cancellation) aborts the request, so that its
KV blocks are freed. Each front-end only says how a request is handed over and how it is abandoned."""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from core.sampling_params import SamplingParams
from frontend.engine.engine import RequestOutput

Queue = asyncio.Queue  # of RequestOutput | BaseException


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
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.active -= 1
            if not finished:
                self._abandon(request_id)
