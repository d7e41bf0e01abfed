"""Rendering of Hugging Face style chat templates in a locked-down Jinja sandbox.

Chat templates ship with model files, so they are untrusted code. Jinja's sandbox already stops
attribute escapes, but by default it answers an unsafe access with an `Undefined` that renders as
an empty string, so a hostile template fails silently. Here every such access is an error, found
when the template is compiled where the name is written literally, and at render time otherwise.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.sandbox as sandbox
from jinja2 import nodes
from jinja2.ext import Extension

__all__ = ["ChatTemplateError", "compile_template", "render_chat"]


class ChatTemplateError(ValueError):
    """A chat template that cannot be compiled, refused by the sandbox, or that raised itself."""


# Attributes that are sandbox escapes even without a leading underscore.
_UNSAFE_NAMES = frozenset(
    {"mro"}
    | sandbox.UNSAFE_FUNCTION_ATTRIBUTES
    | sandbox.UNSAFE_METHOD_ATTRIBUTES
    | sandbox.UNSAFE_GENERATOR_ATTRIBUTES
    | sandbox.UNSAFE_COROUTINE_ATTRIBUTES
    | sandbox.UNSAFE_ASYNC_GENERATOR_ATTRIBUTES
)

# Filters whose `attribute=` argument (or second positional argument, for `attr`) is looked up
# on the items, i.e. an attribute access written as a string.
_ATTRIBUTE_FILTERS = frozenset(
    {"map", "selectattr", "rejectattr", "sort", "groupby", "sum", "unique", "min", "max"}
)


def _is_unsafe_name(name: object) -> bool:
    return isinstance(name, str) and any(
        part.startswith("_") or part in _UNSAFE_NAMES for part in name.split(".")
    )


def _refuse(name: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"chat template refused: access to unsafe attribute {name!r} is not allowed in the sandbox"
    )


class _StrictSandbox(sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, raising where Jinja would quietly yield an undefined value."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise _refuse(attribute)


class _GenerationTag(Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` (assistant-mask markers) as a no-op block.

    Templates that mark assistant turns for training must still render for inference.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """`dict` for templates without exposing the real type (and so `dict.mro()` and friends)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that cannot hold underscore names, which could shadow its internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as Jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            if _is_unsafe_name(name):
                raise _refuse(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        if _is_unsafe_name(name):
            raise _refuse(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised an exception: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's variant: no HTML escaping (Jinja's builtin escapes <, >, &, ') and non-ASCII kept as is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> _StrictSandbox:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _make_env()


def _plain(value: Any) -> Any:
    """A copy made of plain JSON-like types, as transformers does: rich caller objects (arrays,
    images, enums) carry methods the sandbox does not know to be dangerous."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy scalars, ...) go back to the base type.
    for base, convert in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):
            return convert(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return _plain(value.item())  # numpy scalar, so np.bool_(False) stays falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _literal_names(node: nodes.Node) -> Iterator[tuple[str, int]]:
    """Every attribute name the template spells out literally, with its line."""
    for sub in node.find_all((nodes.Getattr, nodes.Getitem, nodes.NSRef, nodes.Filter)):
        if isinstance(sub, nodes.Getattr | nodes.NSRef):
            yield sub.attr, sub.lineno
        elif isinstance(sub, nodes.Getitem) and isinstance(sub.arg, nodes.Const):
            if isinstance(sub.arg.value, str):
                yield sub.arg.value, sub.lineno
        elif isinstance(sub, nodes.Filter) and sub.name == "attr":
            for arg in sub.args:
                if isinstance(arg, nodes.Const) and isinstance(arg.value, str):
                    yield arg.value, sub.lineno
        elif isinstance(sub, nodes.Filter) and sub.name in _ATTRIBUTE_FILTERS:
            for kw in sub.kwargs:
                if kw.key == "attribute" and isinstance(kw.value, nodes.Const):
                    yield str(kw.value.value), sub.lineno


def _check_ast(ast: nodes.Template) -> None:
    bad: dict[str, int] = {}
    for name, lineno in _literal_names(ast):
        if _is_unsafe_name(name):
            bad.setdefault(name, lineno)
    if bad:
        listed = ", ".join(f"{n!r} (line {ln})" for n, ln in sorted(bad.items(), key=lambda kv: kv[1]))
        raise ChatTemplateError(
            f"chat template refused: access to unsafe attribute(s) {listed} is not allowed in the sandbox"
        )


@lru_cache(maxsize=64)
def compile_template(src: str) -> jinja2.Template:
    """Parse, vet and compile a chat template; cached, since servers render the same one per request."""
    try:
        ast = _ENV.parse(src)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
    _check_ast(ast)
    try:
        return _ENV.from_string(ast)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template could not be compiled: {e}") from None


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    continue_final_message: bool = False,
    **extra: Any,
) -> str:
    """Render `messages` with a chat template the way transformers' `apply_chat_template` does.

    Special tokens given as None stay undefined in the template, as they do in transformers when the
    tokenizer has none, so `{% if bos_token is defined %}` behaves the same. Message keys whose
    value is None are dropped too (OpenAI clients send `tool_calls: null`; templates test `is defined`).
    `continue_final_message`: the text ends inside the last message (open_final_message), which the model goes on
    writing (a prefilled reply); rendered without the generation prompt.
    """
    if continue_final_message:
        rendered = render_chat(template, messages, False, bos_token, eos_token, tools, **extra)
        return open_final_message(rendered, str(messages[-1].get("content") or "") if messages else "")
    compiled = compile_template(template)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    context: dict[str, Any] = _plain(extra)
    context.update(messages=_plain(messages), add_generation_prompt=add_generation_prompt, tools=_plain(tools))
    if bos_token is not None:
        context["bos_token"] = bos_token
    if eos_token is not None:
        context["eos_token"] = eos_token
    try:
        return compiled.render(**context)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None


def open_final_message(rendered: str, final: str) -> str:
    """`rendered` cut right after the final message's text, as transformers' continue_final_message cuts it: what
    the template writes after that text (an end-of-turn token, a newline) goes. Found by its last occurrence,
    stripped; its trailing whitespace stays where the template kept it."""
    text = final.strip()
    if not text:
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    at = rendered.rfind(text)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message's text is not in the rendered chat (the "
                                "template rewrites it)")
    kept = final.lstrip()
    return rendered[:at + (len(kept) if rendered.startswith(kept, at) else len(text))]
