"""What every tool-call parser shares: it reads the whole output so far and says which parts are text and which
are calls; the stream is the difference between two such readings, so streaming and non-streaming agree.

A reading must only grow as the text grows: text and arguments already given are never taken back. So a parser
holds back, until the text decides, what may still turn out to be part of a marker (`final=False`), and gives it
all once the output is complete (`final=True`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.tool_parsers.json_scan import decoded, members, skip_ws


@dataclass
class Call:
    """One tool call as far as it is read: its name (known before it is reported) and its arguments' text so far."""

    name: str
    arguments: str = ""


@dataclass
class Reading:
    """The text outside the calls (markers removed) and the calls, in order."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)


class ToolParser:
    """One model family's tool-call format. `tools` is the request's list (OpenAI's shape), for formats that need
    the names or the parameter types."""

    name = ""
    keep_special_tokens = True  # markers are often special tokens, which the detokenizer would otherwise drop

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []

    def segments(self, text: str, final: bool) -> list[str | Call]:
        """The output read as text pieces and calls, in order."""
        raise NotImplementedError

    def read(self, text: str, final: bool) -> Reading:
        return assemble(self.segments(text, final), final)


def assemble(parts: list[str | Call], final: bool) -> Reading:
    """Joins the text pieces: whitespace next to a call goes, and so does trailing whitespace until the output
    ends (a call may follow it), so that what was given never has to change."""
    merged: list[str | Call] = []
    for p in parts:  # neighbouring text pieces are one text
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    parts = merged
    calls = [p for p in parts if isinstance(p, Call)]
    texts: list[str] = []
    for k, part in enumerate(parts):
        if isinstance(part, Call):
            continue
        if k > 0 and isinstance(parts[k - 1], Call):
            part = part.lstrip()
        last = k == len(parts) - 1
        if not last and isinstance(parts[k + 1], Call) or last and (calls or not final):
            part = part.rstrip()
        if part:
            texts.append(part)
    return Reading("\n".join(texts), calls)


def marker_prefix(text: str, *markers: str) -> int:
    """How many characters at the end of `text` could begin one of `markers` (to be held back until known)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def arguments_text(s: str, span: tuple[int, int | None] | None, closed: bool) -> str:
    """A call's arguments as they stream: an object's raw text as far as it goes; a JSON string (arguments already
    encoded) or any other value once complete; `{}` when the call closed without any."""
    if span is None:
        return "{}" if closed else ""
    start, end = span
    if s[start] == "{":
        return s[start:end if end is not None else len(s)]
    if end is None:
        return ""
    value = decoded(s, span)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def json_call_at(s: str, i: int, final: bool, keys: tuple[str, ...] = ("arguments", "parameters")) \
        -> tuple[Call | None, int | None]:
    """The call written as the JSON object `{"name": ..., "arguments": {...}}` at s[i] (after whitespace), and
    where the object ends (None while open). The call is None until its name is known."""
    i = skip_ws(s, i)
    if i >= len(s) or s[i] != "{":
        return None, None
    found, end = members(s, i)
    name = decoded(s, found.get("name"))
    if not isinstance(name, str):
        return None, end
    span = next((found[k] for k in keys if k in found), None)
    return Call(name, arguments_text(s, span, end is not None or final)), end


def text_until(text: str, i: int, marker: str, final: bool) -> tuple[str, int]:
    """The text from i to the next `marker`, and where the marker is (-1 when none is yet; then a tail that may
    begin one is held back unless the output is final)."""
    j = text.find(marker, i)
    if j >= 0:
        return text[i:j], j
    tail = text[i:]
    return (tail if final else tail[:len(tail) - marker_prefix(tail, marker)]), -1


def tagged_calls(text: str, start: str, end: str, final: bool, read: Callable[[str, bool], Call | None]) \
        -> list[str | Call]:
    """Calls written between `start` and `end` tags with text around them; read(body, closed) reads one body, None
    while its name is unknown. A body that closes without a name stays text, tags and all."""
    parts: list[str | Call] = []
    i = 0
    while True:
        piece, j = text_until(text, i, start, final)
        parts.append(piece)
        if j < 0:
            return parts
        close = text.find(end, j + len(start))
        call = read(text[j + len(start):close if close >= 0 else len(text)], final or close >= 0)
        if call is not None:
            parts.append(call)
        elif close >= 0 or final:
            parts.append(text[j:close + len(end) if close >= 0 else len(text)])
        if close < 0:
            return parts
        i = close + len(end)


def json_call_list(text: str, i: int, final: bool, parts: list, keys: tuple[str, ...] = ("arguments", "parameters")) \
        -> int | None:
    """The calls of the JSON list whose '[' is at text[i], appended to `parts`; returns where the list ends (None
    while it is open; where reading stopped if it is not a list of objects)."""
    i += 1
    while True:
        call, end = json_call_at(text, i, final, keys)
        if call is not None:
            parts.append(call)
        if end is None:
            return None
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] == "]":
            return i + 1
        elif i < len(text):
            return i
        else:
            return None
