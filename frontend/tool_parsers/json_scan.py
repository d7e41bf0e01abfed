"""Reading JSON that is still being generated: where a value ends (None while it is open) and the members of an
object seen so far, each with the span of its value, so that a tool call's arguments can stream as raw text."""

from __future__ import annotations

import json
from json.decoder import scanstring

_DECODER = json.JSONDecoder()
WHITESPACE = " \t\n\r"


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WHITESPACE:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i] (after whitespace), or None while it is incomplete (or invalid)."""
    i = skip_ws(s, i)
    if i >= len(s):
        return None
    try:
        _, end = _DECODER.raw_decode(s, i)
    except json.JSONDecodeError:
        return None
    if end == len(s) and s[i] in "-0123456789":  # a number at the end of the text may have more digits to come
        return None
    return end


def members(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object at s[i] ('{') seen so far, key -> (value start, value end or None), and the end of
    the object (None while it is open or once it stops being valid JSON)."""
    out: dict[str, tuple[int, int | None]] = {}
    i += 1
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            return out, None
        if s[i] == "}":
            return out, i + 1
        if s[i] == "," and out:
            i = skip_ws(s, i + 1)
        if i >= len(s) or s[i] != '"':
            return out, None
        try:
            key, j = scanstring(s, i + 1)
        except json.JSONDecodeError:
            return out, None
        j = skip_ws(s, j)
        if j >= len(s) or s[j] != ":":
            return out, None
        start = skip_ws(s, j + 1)
        if start >= len(s):
            return out, None
        end = value_end(s, start)
        out[key] = (start, end)
        if end is None:
            return out, None
        i = end


def decoded(s: str, span: tuple[int, int | None] | None):
    """The value of a complete member, else None."""
    if span is None or span[1] is None:
        return None
    return json.loads(s[span[0]:span[1]])
