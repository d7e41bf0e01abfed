"""A chat choice's output read as OpenAI's message: reasoning_content, content and tool_calls, whole or as stream
deltas. The stream is the difference between successive readings of the whole text so far (the parsers hold back
what is not decided yet), so the deltas of a stream join to what the non-streaming answer says."""

from __future__ import annotations

import argparse
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from frontend.protocol import ChatCompletionRequest, NamedToolChoice
from frontend.reasoning import REASONING_PARSERS, Reasoning, reasoning_for, uses_reasoning
from frontend.tool_parsers import PARSERS, Call, NamedParser, Reading, RequiredParser, ToolParser, detect

log = logging.getLogger(__name__)


@dataclass
class OutputParsing:
    """How one request's outputs are read: its reasoning splitter and tool-call parser (either may be None)."""

    reasoning: Reasoning | None = None
    tools: ToolParser | None = None

    def reader(self) -> ChoiceReader:
        return ChoiceReader(self)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole message for a finished output, and the finish reason to report."""
        r = ChoiceReader(self)
        reasoning, reading = r.read(text, True)
        msg: dict[str, Any] = {"role": "assistant", "content": reading.content or None}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if reading.calls:
            msg["tool_calls"] = [{"id": r.call_id(k), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for k, c in enumerate(reading.calls)]
        elif not reasoning:
            msg["content"] = reading.content  # a plain answer: "" stays a string, as without a parser
        return msg, _finish(finish_reason, bool(reading.calls))


class ChoiceReader:
    """One choice's stream: feed() each new piece of text, get the deltas to send."""

    def __init__(self, parsing: OutputParsing):
        self.parsing = parsing
        self.text = ""
        self.reasoning = ""
        self.sent = Reading()
        self.ids: list[str] = []

    def call_id(self, k: int) -> str:
        while len(self.ids) <= k:
            self.ids.append("call_" + uuid.uuid4().hex[:24])
        return self.ids[k]

    def read(self, text: str, final: bool) -> tuple[str, Reading]:
        reasoning, content = self.parsing.reasoning.split(text, final) if self.parsing.reasoning else ("", text)
        reading = self.parsing.tools.read(content, final) if self.parsing.tools else Reading(content)
        return reasoning, reading

    def feed(self, delta: str, final: bool) -> list[dict[str, Any]]:
        """The deltas (OpenAI's `delta` objects) this piece of text adds; `final` on the output's last piece."""
        self.text += delta
        reasoning, reading = self.read(self.text, final)
        out: list[dict[str, Any]] = []
        if len(reasoning) > len(self.reasoning) and reasoning.startswith(self.reasoning):
            out.append({"reasoning_content": reasoning[len(self.reasoning):]})
            self.reasoning = reasoning
        if len(reading.content) > len(self.sent.content) and reading.content.startswith(self.sent.content):
            out.append({"content": reading.content[len(self.sent.content):]})
            self.sent.content = reading.content
        for k, call in enumerate(reading.calls):
            out += self._call_deltas(k, call)
        return out

    def _call_deltas(self, k: int, call: Call) -> list[dict[str, Any]]:
        out = []
        if k == len(self.sent.calls):  # a new call: its header first
            self.sent.calls.append(Call(call.name))
            out.append({"tool_calls": [{"index": k, "id": self.call_id(k), "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        sent = self.sent.calls[k]
        if len(call.arguments) > len(sent.arguments):
            if not call.arguments.startswith(sent.arguments):  # a parser broke its promise: say so, send no more
                log.warning("tool call %d's arguments changed while streaming: %r -> %r", k, sent.arguments,
                            call.arguments)
                return out
            out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments[len(sent.arguments):]}}]})
            sent.arguments = call.arguments
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return _finish(engine_reason, bool(self.sent.calls))


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class ParserChoice:
    """The server's parsers (--tool-call-parser, --reasoning-parser, resolved against the chat template)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    @classmethod
    def resolve(cls, tool_flag: str, reasoning_flag: str, template: str | None) -> ParserChoice:
        tool = detect(template) if tool_flag == "auto" else None if tool_flag == "none" else tool_flag
        if reasoning_flag == "auto":
            reasoning = "qwen3" if uses_reasoning(template) else None
        else:
            reasoning = None if reasoning_flag == "none" else reasoning_flag
        return cls(tool, reasoning)

    @staticmethod
    def add_flags(ap: argparse.ArgumentParser) -> None:
        group = ap.add_argument_group("chat output (tool calls and reasoning)")
        group.add_argument("--tool-call-parser", metavar="NAME", choices=["auto", "none", *PARSERS], default="auto",
                           help=f"how tool calls are read from the output: {', '.join(PARSERS)}; auto (the default): "
                           "from the chat template's markers; none: returned as text")
        group.add_argument("--enable-auto-tool-choice", action="store_true",
                           help="accepted for vLLM's command lines; tool_choice auto is always on")
        group.add_argument("--reasoning-parser", metavar="NAME", choices=["auto", "none", *REASONING_PARSERS],
                           default="auto", help="split <think>...</think> into reasoning_content: deepseek_r1 (the "
                           "output starts in it), qwen3 (where the prompt leaves it); auto (the default): qwen3's "
                           "rule when the template writes <think>; none: off")

    def for_request(self, req: ChatCompletionRequest, prompt: str) -> OutputParsing | None:
        """How this request's outputs are read (None: as plain text); `prompt` is its rendered template."""
        reasoning = reasoning_for(self.reasoning_parser, prompt)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        choice = req.tool_choice or "auto"
        parser: ToolParser | None = None
        if not tools or choice == "none":
            parser = None
        elif choice == "required" or isinstance(choice, NamedToolChoice):
            # the schema constrains the output from its first token, so none of it is reasoning
            reasoning = None
            parser = RequiredParser(tools) if choice == "required" else NamedParser(choice.function.name, tools)
        elif self.tool_parser is not None:
            parser = PARSERS[self.tool_parser](tools)
        if reasoning is None and parser is None:
            return None
        return OutputParsing(reasoning, parser)
