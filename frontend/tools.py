"""Tools on the request side: the checks OpenAI's schema cannot say, the messages as chat templates want them
(a call's arguments as a dict), and the JSON schema that tool_choice "required" or a named function imposes."""

from __future__ import annotations

import json
from typing import Any

from core.sampling_params import SamplingParams, StructuredOutput
from frontend.chat_output import OutputParsing
from frontend.errors import bad_request
from frontend.protocol import ChatCompletionRequest, Message, NamedToolChoice, TokenizeRequest, ToolDef


def check_tools(tools: list[ToolDef] | None, choice: Any) -> None:
    """400 for duplicate names, parameters that are not an object schema, or a tool_choice the tools cannot meet."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        fn = tool.function
        if fn.name in seen:
            raise bad_request(f"tools.{i}.function.name: {fn.name!r} is given twice", f"tools.{i}.function.name")
        seen.add(fn.name)
        _check_parameters(fn.parameters, f"tools.{i}.function.parameters")
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        if not tools:
            raise bad_request("tool_choice requires tools: none are given", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(sorted(seen))})", "tool_choice")


def _check_parameters(params: dict[str, Any] | None, where: str) -> None:
    if not params:
        return  # no parameters: the function takes none
    if params.get("type") != "object":
        raise bad_request(f"{where}: must be a JSON schema of type \"object\", got type {params.get('type')!r}", where)
    if not isinstance(params.get("properties", {}), dict):
        raise bad_request(f"{where}.properties: must be an object of property schemas", f"{where}.properties")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad_request(f"{where}.required: must be a list of property names", f"{where}.required")


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as templates read them: developer as system, tool calls with their arguments decoded (the
    templates index them as a dict, as vLLM hands them over), tool results with their call's id."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments,
                                                                 f"messages.{i}.tool_calls.{j}.function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise bad_request(f"{where}: not valid JSON ({e.msg} at character {e.pos})", where) from None


def template_tools(req: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]] | None:
    """The tools as templates read them (OpenAI's shape, unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """What the template gets beside the messages: tools, chat_template_kwargs, and reasoning_effort as vLLM hands
    it over ("none" also sets enable_thinking false, the switch most thinking templates read)."""
    kwargs = dict(req.chat_template_kwargs or {})
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
    return {"tools": template_tools(req), **kwargs}


def tool_params(req: ChatCompletionRequest, params: SamplingParams, parsing: OutputParsing | None) -> None:
    """Markers kept in the text for the tool parser."""
    if parsing is not None and parsing.tools is not None and parsing.tools.keep_special_tokens:
        params.skip_special_tokens = False  # as vLLM's parsers ask: [TOOL_CALLS], <|python_tag|> are special


def tool_constraint(req: ChatCompletionRequest) -> StructuredOutput | None:
    """The JSON schema tool_choice "required" or a named function holds the output to (None: free text), checked
    with the request's other constraints (frontend/structured_request.py)."""
    schema = tool_schema(req.tools, req.tool_choice, req.parallel_tool_calls is not False) if req.tools else None
    return None if schema is None else StructuredOutput("json_schema", json.dumps(schema))


def tool_schema(tools: list[ToolDef], choice: Any, parallel: bool = True) -> dict[str, Any] | None:
    """The JSON schema the output must match: for "required" a non-empty list of {name, parameters} (vLLM's
    shape; one call at most unless `parallel`: parallel_tool_calls), for a named function its parameters; None for
    "auto" and "none"."""
    def params(t: ToolDef) -> dict[str, Any]:
        return t.function.parameters or {"type": "object", "properties": {}}

    if isinstance(choice, NamedToolChoice):
        return next(params(t) for t in tools if t.function.name == choice.function.name)
    if choice != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": params(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}} | (
        {"maxItems": 1} if not parallel else {})
