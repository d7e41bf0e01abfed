"""A StructuredOutput compiled into llguidance's grammar text, once per (kind, spec) and checked, so that a bad
schema, regex or grammar is refused with the library's message before anything is queued."""

from __future__ import annotations

import functools
import json

import llguidance

from core.sampling_params import StructuredOutput

__all__ = ["JSON_WHITESPACE", "GrammarError", "compile_grammar", "compile_structured"]

# Whitespace JSON may hold between tokens: a few characters at each place, not any run. With any run allowed a model
# (a random one always, a real one at times) can pick whitespace tokens forever and end by length, never valid.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,8}"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


class GrammarError(ValueError):
    """A constraint the library cannot compile; the message names what is wrong."""


def compile_structured(so: StructuredOutput) -> str:
    """llguidance's grammar for a request's constraint (raises GrammarError)."""
    return compile_grammar(so.kind, so.spec)


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str | None) -> str:
    """llguidance's grammar for (kind, spec), validated; cached, since agents send the same schema again and again."""
    try:
        if kind in ("json_object", "json_schema"):
            schema = '{"type": "object"}' if kind == "json_object" or spec is None else spec
            if not isinstance(json.loads(schema), dict):
                raise GrammarError("the JSON schema must be a JSON object")
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
