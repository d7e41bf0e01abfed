"""The JSON schemas, regexes, choices and grammar the structured-output tests hold every output to, and the checks.

Every string, array and object is bounded (maxLength, maxItems, closed objects): on random weights only the mask
ends a string, so an unbounded one would run to max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema

INT = {"type": "integer", "minimum": 0, "maximum": 9}
NAME = {"type": "string", "maxLength": 8}


def closed(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


POINT = closed({"x": INT, "y": INT})
SCHEMAS = [
    closed({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    closed({"user": closed({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                            "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,5}\\.com$"}})}),
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    closed({"color": {"enum": ["red", "green", "blue"]}}),
    closed({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    closed({"temp": {"type": "number", "minimum": -10, "maximum": 40}}),
    closed({"code": {"type": "string", "minLength": 3, "maxLength": 5}}),
    closed({"v": {"anyOf": [INT, {"type": "string", "maxLength": 4}]}}),
    closed({"shape": {"oneOf": [closed({"kind": {"const": "circle"}, "r": INT}),
                                closed({"kind": {"const": "square"}, "side": INT})]}}),
    closed({"items": {"type": "array", "maxItems": 3,
                      "items": closed({"name": {"type": "string", "maxLength": 6},
                                       "qty": {"type": "integer", "minimum": 1, "maximum": 20}})}}),
    closed({"matrix": {"type": "array", "maxItems": 3, "items": {"type": "array", "items": INT, "maxItems": 3}}}),
    closed({"version": {"const": 2}, "name": NAME}),
    closed({"a": INT, "b": NAME, "c": {"type": "boolean"}}, required=["a"]),
    {"enum": ["alpha", "beta", "gamma"]},
    closed({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    closed({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
    closed({"maybe": {"type": ["string", "null"], "maxLength": 5}}),
    closed({"a": closed({"b": closed({"c": {"type": "boolean"}})})}),
    closed({"pair": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, INT], "items": False,
                     "minItems": 2}}),
    {"$defs": {"pt": POINT}, **closed({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
]
REGEX = r"[A-Z]{2}-[0-9]{3}( ok)?"
CHOICES = ["yes", "no", "maybe later"]
# Lark: a sum of small numbers
GRAMMAR = 'start: num (" + " num){0,3}\nnum: /[1-9][0-9]?/'
GRAMMAR_RE = re.compile(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,3}")


def check_json(text: str, schema: dict) -> None:
    """The text parses as JSON and validates against the schema (jsonschema, independent of the mask's library)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"not JSON ({e}): {text!r}") from None
    jsonschema.validate(value, schema)
