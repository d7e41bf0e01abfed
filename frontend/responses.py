"""OpenAI response bodies and stream chunks, built from the engine's outputs."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend.engine.engine import CompletionOutput


@dataclass
class Reply:
    """What one chat or completion request accumulates, and how it names itself."""

    kind: str  # "chat" or "text"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def usage(self) -> dict[str, Any]:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def chunk(self, choices: list[dict[str, Any]], usage: bool | None) -> str:
        """One SSE event; `usage` None leaves the field out, False writes null, True the figures."""
        body: dict[str, Any] = {"id": self.id, "object": self.object + ("" if self.kind == "text" else ".chunk"),
                                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = self.usage() if usage else None
        return sse(body)


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


def chat_choice(index: int, out: CompletionOutput, logprobs: dict | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


def chat_delta(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
               stop_reason: str | int | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def parsed_choice(index: int, message: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None,
                  logprobs: dict | None) -> dict[str, Any]:
    """A chat choice whose output was read by the tool-call and reasoning parsers (frontend/chat_output.py)."""
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def parsed_delta(index: int, delta: dict[str, Any], logprobs: dict | None, finish_reason: str | None,
                 stop_reason: str | int | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def text_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                stop_reason: str | int | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice
