"""A request's structured-output fields (OpenAI's response_format, vLLM's structured_outputs and guided_*) as one
StructuredOutput, compiled here in the API process so that a bad schema, regex or grammar is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

from core.sampling_params import StructuredOutput
from frontend.engine.grammar import GrammarError, compile_structured
from frontend.errors import bad_request

__all__ = ["request_constraint"]

_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object"}


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        return schema  # compiled below: a string that is no JSON object is refused there
    if isinstance(schema, dict):
        return json.dumps(schema)
    raise bad_request(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)


def _response_format(fmt: dict[str, Any]) -> StructuredOutput | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request('response_format: type "json_schema" needs "json_schema": {"name": ..., "schema": '
                              '{...}}', "response_format")
        return StructuredOutput("json_schema", _schema_text(spec["schema"], "response_format"))
    raise bad_request(f'response_format: type must be "text", "json_object" or "json_schema", got {kind!r}',
                      "response_format")


def _vllm(fields: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    found = []
    for key, value in fields.items():
        if value is None or value is False or key not in _VLLM_KEYS:
            continue  # vLLM's other options (disable_fallback, whitespace_pattern, ...) do not constrain
        param = f"structured_outputs.{key}"
        if key == "json":
            found.append((param, StructuredOutput("json_schema", _schema_text(value, param))))
        elif key == "json_object":
            found.append((param, StructuredOutput("json_object")))
        elif key == "choice":
            found.append((param, StructuredOutput("choice", json.dumps(value))))
        elif not isinstance(value, str):
            raise bad_request(f"{param} must be a string, got {type(value).__name__}", param)
        else:
            found.append((param, StructuredOutput(_VLLM_KEYS[key], value)))
    return found


def request_constraint(req, tool: StructuredOutput | None = None) -> StructuredOutput | None:
    """The constraint a chat or completion request asks for (None: free text), `tool` the one its tool_choice sets;
    raises a 400 APIError for two constraints at once, a malformed field or one the library cannot compile."""
    found: list[tuple[str, StructuredOutput]] = [("tool_choice", tool)] if tool is not None else []
    if req.response_format is not None and (so := _response_format(req.response_format)) is not None:
        found.append(("response_format", so))
    found += _vllm(req.structured_outputs or {})
    if req.guided_json is not None:
        found.append(("guided_json", StructuredOutput("json_schema", _schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput("choice", json.dumps(req.guided_choice))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput("grammar", req.guided_grammar)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise bad_request(f"at most one structured-output constraint a request; got {names}", found[1][0])
    param, so = found[0]
    try:
        compile_structured(so)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return so
