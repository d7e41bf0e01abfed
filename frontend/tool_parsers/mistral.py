"""Mistral: `[TOOL_CALLS]` then, before tokenizer v11, a JSON list `[{"name": ..., "arguments": {...}}, ...]`; from
v11 on, `name[ARGS]{...}` (optionally `name[CALL_ID]id[ARGS]{...}`), the marker again before each further call."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, ToolParser, arguments_text, json_call_list, text_until
from frontend.tool_parsers.json_scan import skip_ws, value_end

MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser(ToolParser):
    name = "mistral"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        parts: list[str | Call] = []
        i = 0
        while True:
            piece, j = text_until(text, i, MARK, final)
            parts.append(piece)
            if j < 0:
                return parts
            k = skip_ws(text, j + len(MARK))
            if k >= len(text):
                return parts
            end = json_call_list(text, k, final, parts) if text[k] == "[" else self._named(text, k, final, parts)
            if end is None:
                return parts
            i = end

    @staticmethod
    def _named(text: str, k: int, final: bool, parts: list) -> int | None:
        """v11+: `name[ARGS]{...}` at text[k]; returns where the arguments end (None while open)."""
        a = text.find(ARGS, k)
        if a < 0:
            return None
        name = text[k:a]
        if CALL_ID in name:
            name = name[:name.index(CALL_ID)]
        start = skip_ws(text, a + len(ARGS))
        if start >= len(text):
            parts.append(Call(name.strip()))
            return None
        end = value_end(text, start)
        parts.append(Call(name.strip(), arguments_text(text, (start, end), end is not None or final)))
        return end
