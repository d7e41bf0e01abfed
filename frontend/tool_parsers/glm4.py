"""GLM: GLM-4.5 and later write `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...</tool_call>`
(values are text: JSON where it parses and the parameter is not a string); GLM-4 (9B-chat, 0414) writes the tool's
name on a line, then its arguments as JSON, as the whole output."""

from __future__ import annotations

import json

from frontend.tool_parsers.base import Call, ToolParser, arguments_text, tagged_calls
from frontend.tool_parsers.json_scan import skip_ws, value_end

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class Glm4Parser(ToolParser):
    name = "glm4"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        if START not in text:
            bare = self._bare(text, final)
            if bare is not None:
                return bare
        return tagged_calls(text, START, END, final, self._call)

    def _call(self, body: str, closed: bool) -> Call | None:
        cut = [p for p in (body.find(KEY), body.find("\n")) if p >= 0]
        if not cut and not closed:
            return None
        name_end = min(cut) if cut else len(body)
        name, pairs, i = body[:name_end].strip(), [], name_end
        while (k := body.find(KEY, i)) >= 0:
            ke = body.find(KEY_END, k)
            v = body.find(VALUE, ke) if ke >= 0 else -1
            ve = body.find(VALUE_END, v) if v >= 0 else -1
            if ve < 0:
                break
            key = body[k + len(KEY):ke].strip()
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {self._value(name, key, body[v + len(VALUE):ve])}")
            i = ve + len(VALUE_END)
        args = "{" + ", ".join(pairs) + ("}" if closed else "")
        return Call(name, args)

    def _value(self, tool: str, key: str, raw: str) -> str:
        kind = self._param_type(tool, key)
        if kind != "string":
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False)
            except ValueError:
                pass
        return json.dumps(raw, ensure_ascii=False)

    def _param_type(self, tool: str, key: str) -> str | None:
        for t in self.tools:
            fn = t.get("function", {})
            if fn.get("name") == tool:
                return ((fn.get("parameters") or {}).get("properties") or {}).get(key, {}).get("type")
        return None

    def _bare(self, text: str, final: bool) -> list[str | Call] | None:
        """GLM-4's `name\\n{...}`, for the request's own tool names only; None when the output is not one."""
        start = skip_ws(text, 0)
        for t in self.tools:
            head = t.get("function", {}).get("name", "") + "\n"
            if not text.startswith(head, start):
                if head.startswith(text[start:]) and not final and len(text[start:]) < len(head):
                    return []  # still maybe this name
                continue
            k = skip_ws(text, start + len(head))
            if k >= len(text) or text[k] != "{":
                return None if k < len(text) or final else []
            end = value_end(text, k)
            rest = [text[end:]] if end is not None else []
            return [Call(head.strip(), arguments_text(text, (k, end), end is not None or final)), *rest]
        return None
