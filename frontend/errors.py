"""Errors in OpenAI's body: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation(err: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path (`messages.0.content`)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    tag_at = next((i for i, p in enumerate(first["loc"]) if _is_union_tag(p)), None)
    if tag_at is not None:  # a union: say what the field may be, unless one member got deep into the value
        prefix = first["loc"][:tag_at]
        members = [e for e in errors if e["loc"][:tag_at] == prefix and len(e["loc"]) > tag_at]
        deepest = max(members, key=lambda e: len(e["loc"]))
        if len(deepest["loc"]) - tag_at < 3 or not isinstance(deepest["loc"][-1], str):
            tags = dict.fromkeys(_UNION_WORDS.get(e["loc"][tag_at], e["loc"][tag_at]) for e in members)
            return bad_request(f"{_path(prefix)}: expected {' or '.join(tags)} (got {_shown(first['input'])})",
                               _path(prefix))
        first = deepest
    loc = _path(first["loc"])
    message = f"{loc}: {first['msg']}" if loc else first["msg"]
    if first["type"] == "model_type" and not loc:
        message = "the request body must be a JSON object"
    elif first["type"] == "json_invalid":
        message = f"the body is not valid JSON: {first['msg']}"
    elif first["type"] not in ("missing", "model_type"):
        message += f" (got {_shown(first.get('input'))})"
    return bad_request(message, loc or None)


_UNION_WORDS = {"str": "a string", "constrained-str": "a non-empty string", "list[str]": "a list of strings",
                "list[constrained-int]": "a list of token ids", "list[list[constrained-int]]":
                "a list of lists of token ids", "list[TextPart]": "a list of text parts", "dict[str,any]": "an object",
                "Message": "a message", "none": "null"}


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not _is_union_tag(p))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried (`str`, `list[int]`, ...) inside the field path
    return isinstance(part, str) and ("[" in part or part.startswith("constrained-") or
                                      part in {"str", "int", "float", "bool", "none"})
