"""Tool-call parsers, one module a model family, chosen by --tool-call-parser or from the chat template's markers."""

from __future__ import annotations

from frontend.tool_parsers.base import Call, Reading, ToolParser
from frontend.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from frontend.tool_parsers.forced import NamedParser, RequiredParser
from frontend.tool_parsers.glm4 import Glm4Parser
from frontend.tool_parsers.hermes import HermesParser
from frontend.tool_parsers.llama3_json import Llama3JsonParser
from frontend.tool_parsers.mistral import MistralParser
from frontend.tool_parsers.pythonic import PythonicParser

__all__ = ["PARSERS", "Call", "NamedParser", "Reading", "RequiredParser", "ToolParser", "detect"]

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser, Glm4Parser, PythonicParser)}

# The first marker a template holds names its family; GLM-4.5's <tool_call> comes before Hermes's.
_MARKERS = (
    ("[TOOL_CALLS]", "mistral"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<arg_key>", "glm4"),
    ("<|observation|>", "glm4"),
    ("<tool_call>", "hermes"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ("dictionary of argument name", "llama3_json"),
)


def detect(template: str | None) -> str | None:
    """The parser a chat template's markers point to, or None (tools then reach the template, and the output is
    returned as text)."""
    for marker, name in _MARKERS:
        if template and marker in template:
            return name
    return None
