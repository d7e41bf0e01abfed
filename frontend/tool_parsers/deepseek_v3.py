"""DeepSeek V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1's calls are
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, ToolParser, arguments_text, text_until
from frontend.tool_parsers.json_scan import skip_ws, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        piece, j = text_until(text, 0, CALLS_BEGIN, final)
        parts: list[str | Call] = [piece]
        if j < 0:
            return parts
        i = j + len(CALLS_BEGIN)
        while True:
            i = skip_ws(text, i)
            if text.startswith(CALLS_END, i):
                return parts + [text[i + len(CALLS_END):]]
            if not text.startswith(CALL_BEGIN, i):
                return parts  # the next marker is not here yet (or the output is cut)
            end = self._call(text, i + len(CALL_BEGIN), final, parts)
            if end is None:
                return parts
            i = end

    @staticmethod
    def _call(text: str, i: int, final: bool, parts: list) -> int | None:
        sep = text.find(SEP, i)
        if sep < 0:
            return None
        head, k = text[i:sep].strip(), sep + len(SEP)
        if head == "function":  # V3: the name on the line after the separator, the arguments in a json fence
            line = text.find("\n", k)
            if line < 0:
                return None
            name, k = text[k:line].strip(), skip_ws(text, line)
            if text.startswith(FENCE, k):
                k += len(FENCE)
            elif FENCE.startswith(text[k:]) and not final:
                parts.append(Call(name))
                return None
        else:
            name = head
        start = skip_ws(text, k)
        close = text.find(CALL_END, start)
        if start >= len(text) or start == close:
            parts.append(Call(name, "{}" if close >= 0 else ""))
            return None if close < 0 else close + len(CALL_END)
        end = value_end(text, start)
        parts.append(Call(name, arguments_text(text, (start, end), end is not None or final)))
        if close < 0:
            return None
        return close + len(CALL_END)
