"""Llama 3.1/3.2/3.3 (JSON tool calling): the output is a bare JSON object `{"name": ..., "parameters": {...}}`, or
several separated by `;`, optionally after `<|python_tag|>`; anything else is plain text."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, ToolParser, json_call_at
from frontend.tool_parsers.json_scan import skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        i = skip_ws(text, 0)
        if text.startswith(TAG, i):
            i = skip_ws(text, i + len(TAG))
        elif TAG.startswith(text[i:]) and not final:
            return []  # maybe the tag: undecided
        if i >= len(text):
            return [] if not final or text.strip() == "" else [text[i:]]
        if text[i] != "{":
            return [text[i:] if TAG in text[:i] else text]  # not JSON: text (the tag, a marker, left out)
        calls: list[str | Call] = []
        while True:
            call, end = json_call_at(text, i, final)
            if call is None:  # an object that is not a call: text from here on (once that is known)
                if end is None and not final:
                    return calls
                return calls + [text[i:]] if calls else [text]
            calls.append(call)
            if end is None:
                return calls
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return calls + ([text[i:]] if i < len(text) else [])
