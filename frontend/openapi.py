"""`GET /openapi.json`: the request schemas are the ones the server validates with; the response schemas
below describe what frontend/responses.py writes (a schemathesis test checks that they agree)."""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: str | int | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    """A stream's piece: first a call's index, id, type and name (arguments ""), then its argument fragments."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Health(BaseModel):
    status: Literal["ok"]


_MODELS = [ChatCompletionRequest, CompletionRequest, EmbeddingRequest, TokenizeRequest, DetokenizeRequest,
           ErrorResponse, ModelList, ModelCard,
           ChatCompletion, Completion, ChatCompletionChunk, CompletionChunk, EmbeddingList, TokenizeResponse,
           DetokenizeResponse, Health]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _errors(*codes: int) -> dict[str, Any]:
    words = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model", 429: "too many waiting"}
    return {str(c): {"description": words[c], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            for c in codes}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 reads `schema` of an event stream as one event's): its data is a
    JSON chunk, an error body, or the final `[DONE]`."""
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"}, {
            "type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}],
            "description": "a JSON chunk, an error body, or the final [DONE]"}}}


def _post(summary: str, request: type[BaseModel], response: type[BaseModel],
          chunk: type[BaseModel] | None) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref(response)}}
    if chunk:  # with "stream": true the answer is server-sent events of chunks, ended by `data: [DONE]`
        content["text/event-stream"] = {"schema": _sse_event(chunk)}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": _ref(request)}}}, "responses": {
        "200": {"description": "OK", "content": content}} | _errors(400, 401, 404, 429)}}


def _get(summary: str, response: type[BaseModel] | None, media: str = "application/json") -> dict[str, Any]:
    schema = _ref(response) if response else {"type": "string"}
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {
        media: {"schema": schema}}}}}}


@cache
def openapi_document(model_id: str) -> dict[str, Any]:
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "llm-engine OpenAI-compatible API", "version": "0.1.0",
                 "description": f"Serving {model_id}."},
        "paths": {
            "/v1/chat/completions": _post("Chat completion", ChatCompletionRequest, ChatCompletion,
                                          ChatCompletionChunk),
            "/v1/completions": _post("Text completion", CompletionRequest, Completion, CompletionChunk),
            "/v1/embeddings": _post("Embeddings (an embedding model's)", EmbeddingRequest, EmbeddingList, None),
            "/v1/models": _get("The served model", ModelList),
            "/v1/models/{model}": {"get": {"summary": "One model", "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
                 "example": model_id}],
                "responses": {"200": {"description": "OK", "content": {"application/json": {
                    "schema": _ref(ModelCard)}}}} | _errors(404)}},
            "/tokenize": _post("Tokenize a prompt or a conversation", TokenizeRequest, TokenizeResponse, None),
            "/detokenize": _post("Token ids to text", DetokenizeRequest, DetokenizeResponse, None),
            "/health": _get("Liveness", Health),
            "/metrics": _get("Prometheus metrics", None, "text/plain"),
        },
        "components": {"schemas": defs["$defs"]},
    }
