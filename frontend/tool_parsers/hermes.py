"""Hermes and Qwen2.5/Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them,
text around them."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, ToolParser, json_call_at, tagged_calls

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        return tagged_calls(text, START, END, final, lambda body, closed: json_call_at(body, 0, closed)[0])
