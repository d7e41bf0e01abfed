"""The output of a request whose tool_choice forces calls, shaped by the JSON schema of tool_schemas: for
"required", a list `[{"name": ..., "parameters": {...}}, ...]`; for a named function, its arguments object alone."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, ToolParser, arguments_text, json_call_list
from frontend.tool_parsers.json_scan import skip_ws, value_end


class RequiredParser(ToolParser):
    """tool_choice "required": a JSON list of calls."""

    name = "required"
    keep_special_tokens = False

    def segments(self, text: str, final: bool) -> list[str | Call]:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return [text] if final else []
        parts: list[str | Call] = []
        json_call_list(text, i, final, parts, keys=("parameters", "arguments"))
        return parts


class NamedParser(ToolParser):
    """tool_choice naming a function: the whole output is that function's arguments."""

    name = "named"
    keep_special_tokens = False

    def __init__(self, function: str, tools: list[dict] | None = None):
        super().__init__(tools)
        self.function = function

    def segments(self, text: str, final: bool) -> list[str | Call]:
        start = skip_ws(text, 0)
        if start >= len(text):
            return [Call(self.function, "{}")] if final else []
        if text[start] != "{":
            return [Call(self.function, text.strip())] if final else [Call(self.function)]
        end = value_end(text, start)
        return [Call(self.function, arguments_text(text, (start, end), end is not None or final))]
