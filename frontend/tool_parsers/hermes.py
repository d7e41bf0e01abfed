"""Hermes and Qwen2.5/Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them,
text around them."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, ToolParser, json_call_at, marker_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        parts: list[str | Call] = []
        i = 0
        while True:
            j = text.find(START, i)
            if j < 0:
                tail = text[i:]
                parts.append(tail if final else tail[:len(tail) - marker_prefix(tail, START)])
                return parts
            parts.append(text[i:j])
            k = j + len(START)
            close = text.find(END, k)
            body = text[k:close] if close >= 0 else text[k:]
            call, _ = json_call_at(body, 0, final or close >= 0)
            if call is not None:
                parts.append(call)
            elif close >= 0 or final:  # not a call after all: the model's text, markers and all
                parts.append(text[j:close + len(END) if close >= 0 else len(text)])
            if close < 0:
                return parts
            i = close + len(END)
