"""Reasoning content: the text between `<think>` and `</think>` goes to `reasoning_content`, the rest to `content`.

Some templates open `<think>` in the prompt (DeepSeek-R1, Qwen3's thinking models), so the output starts inside
the reasoning and only `</think>` shows where it ends: the prompt tells which case a request is in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from frontend.tool_parsers.base import marker_prefix

START, END = "<think>", "</think>"
_LEADING_WS = re.compile(r"\s*")
# deepseek_r1: the output starts in the reasoning whatever the prompt; qwen3 and auto: where the prompt leaves it
# (an output that opens <think> itself is read as reasoning in every case).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def uses_reasoning(template: str | None) -> bool:
    """The automatic choice: templates that write the thinking markers."""
    return bool(template) and (START in template or END in template)


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>`."""
    return prompt.rfind(START) > prompt.rfind(END)


@dataclass
class Reasoning:
    """Splits one output; `starts_inside`: the prompt left it in the reasoning."""

    starts_inside: bool

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far; a marker not yet whole is held back until it is."""
        lead = _LEADING_WS.match(text).end()
        if text.startswith(START, lead):
            inside, i = True, lead + len(START)
        elif START.startswith(text[lead:lead + len(START)]) and lead + len(START) > len(text) and not final:
            return "", ""  # whitespace, or the start of <think>: undecided
        else:
            inside, i = self.starts_inside, 0
        if not inside:
            return "", text
        j = text.find(END, i)
        if j < 0:
            rest = text[i:]
            return (rest if final else rest[:len(rest) - marker_prefix(rest, END)]), ""
        return text[i:j], text[j + len(END):].lstrip()


def reasoning_for(name: str | None, prompt: str) -> Reasoning | None:
    """The request's splitter under --reasoning-parser `name` (resolved: None is off)."""
    if name is None:
        return None
    return Reasoning(starts_inside=name == "deepseek_r1" or prompt_opens_reasoning(prompt))
