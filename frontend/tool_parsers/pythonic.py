"""Pythonic calls (Llama 4, Gemma and others by prompt): the output is a Python list of calls with literal keyword
arguments, `[f(a=1), g(b="x")]`, optionally between `<|python_start|>` and `<|python_end|>`. Each call's arguments
come in one piece, once its closing parenthesis is read."""

from __future__ import annotations

import ast
import json
import re

from frontend.tool_parsers.base import Call, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_OPENING = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_OPENING = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")
_NEXT_NAME = re.compile(r"\s*,?\s*([A-Za-z_][\w.]*)\s*\(")


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else f"{_name(node.value)}.{node.attr}"  # type: ignore[attr-defined]


def _calls(source: str) -> list[Call] | None:
    """The calls of a complete list, or None when `source` is not one."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) and not c.args for c in tree.elts):
            return None
        return [Call(_name(c.func), json.dumps({k.arg: ast.literal_eval(k.value) for k in c.keywords},
                                               ensure_ascii=False)) for c in tree.elts]
    except (SyntaxError, ValueError, TypeError, AttributeError, RecursionError):
        return None


class PythonicParser(ToolParser):
    name = "pythonic"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START):].strip()
        body = body[:-len(END)].strip() if body.endswith(END) else body
        if not _OPENING.match(body):
            undecided = _MAYBE_OPENING.fullmatch(body) or START.startswith(body)
            return [] if undecided and not final else [text]
        whole = _calls(body)
        if whole is not None:
            return list(whole)
        done: list[Call] = []
        for p in [m.end() for m in re.finditer(r"\)", body)][::-1]:  # the longest prefix of whole calls
            found = _calls(body[:p] + "]")
            if found is not None:
                done, rest = found, body[p:]
                break
        else:
            rest = body[1:]
        following = _NEXT_NAME.match(rest)
        if following:
            return [*done, Call(following.group(1))]
        return done if done or not final else [text]
