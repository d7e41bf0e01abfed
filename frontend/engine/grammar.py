"""A StructuredOutput compiled into llguidance's grammar text, once per (kind, spec) and checked, so that a bad
schema, regex or grammar is refused with the library's message before anything is queued."""

from __future__ import annotations

import functools
import json

import llguidance

from core.sampling_params import StructuredOutput

__all__ = ["JSON_WHITESPACE", "GrammarError", "closed_objects", "compile_grammar", "compile_structured"]

# Whitespace JSON may hold between tokens: a few characters at each place, not any run. With any run allowed a model
# (a random one always, a real one at times) can pick whitespace tokens forever and end by length, never valid.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,8}"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


# Keywords whose values are subschemas (one, a list, or a map of names to subschemas): where closed_objects looks.
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_BESIDE = ("$ref", "anyOf", "oneOf", "if", "dependentSchemas", "dependencies")


class GrammarError(ValueError):
    """A constraint the library cannot compile; the message names what is wrong."""


def closed_objects(schema):
    """The schema with `"additionalProperties": false` on each object schema that lists `properties` and says nothing
    of other keys (nor requires one it does not list), as vLLM's default backend (xgrammar, strict mode) and
    llama.cpp's json-schema-to-grammar hold it: a model asked for {name, age} writes those keys, not whatever else it
    likes (JSON Schema's own default, which llguidance follows, admits any other key). `"additionalProperties": true`
    keeps an object open. A schema that composes objects (`allOf`; `$ref`, `anyOf`, `oneOf`, `if` or dependencies
    beside `properties`) is left as written: closing one part would forbid the other parts' keys, and
    unevaluatedProperties, which would not, is a keyword llguidance does not implement."""
    if _composes(schema):
        return schema
    return _close(schema)


def _composes(schema) -> bool:
    if isinstance(schema, list):
        return any(_composes(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    beside = "properties" in schema and any(k in schema for k in _BESIDE)  # their keys add to the properties'
    return "allOf" in schema or beside or any(map(_composes, schema.values()))


def _close(schema):
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _MAP and isinstance(value, dict):
            value = {name: _close(sub) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            value = [_close(sub) for sub in value]
        elif key in _ONE:
            value = _close(value)
        out[key] = value
    props = schema.get("properties")
    named = set(props) if isinstance(props, dict) else set()
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    # a required key the properties do not list is another key the schema asks for: closed, it could not be written
    if props is not None and not any(key in schema for key in _OPEN) and named.issuperset(required):
        out["additionalProperties"] = False
    return out


def compile_structured(so: StructuredOutput) -> str:
    """llguidance's grammar for a request's constraint (raises GrammarError)."""
    return compile_grammar(so.kind, so.spec)


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str | None) -> str:
    """llguidance's grammar for (kind, spec), validated; cached, since agents send the same schema again and again."""
    try:
        if kind in ("json_object", "json_schema"):
            schema = json.loads('{"type": "object"}' if kind == "json_object" or spec is None else spec)
            if not isinstance(schema, dict):
                raise GrammarError("the JSON schema must be a JSON object")
            schema = json.dumps(closed_objects(schema))
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        elif kind == "choice":
            choices = json.loads(spec or "null")
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise GrammarError("choice must be a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", choices)
        elif kind == "regex":
            grammar = llguidance.grammar_from("regex", spec or "")
        elif kind == "grammar":
            # Lark as it is, or GBNF (llama.cpp's) translated to Lark by the library
            grammar = llguidance.grammar_from("grammar", spec or "")
        else:
            raise GrammarError(f"unknown structured output kind {kind!r}")
    except GrammarError:
        raise
    except ValueError as e:  # json's errors too
        raise GrammarError(str(e)) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(messages[0].strip())
    return grammar
