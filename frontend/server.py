"""The Sanic app: routes, the API key check, and OpenAI error bodies for everything that goes wrong."""

from __future__ import annotations

import hmac
import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.response import HTTPResponse, JSONResponse, json, raw

from frontend.embeddings import embeddings
from frontend.errors import APIError, from_validation
from frontend.metrics import CONTENT_TYPE
from frontend.openapi import openapi_document
from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from frontend.serving import OpenAIServing, encode_texts, off_loop
from frontend.webui import add_routes as add_webui_routes

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def parse(model: type[M], request: Request) -> M:
    try:
        return model.model_validate_json(request.body or b"")
    except ValidationError as e:
        raise from_validation(e) from None


def error_response(err: APIError) -> JSONResponse:
    return json(err.body(), status=err.status)


def build_app(serving: OpenAIServing, api_key: str | None = None, name: str = "llm_engine") -> Sanic:
    app = Sanic(name, configure_logging=False)
    # Generation can take minutes; Sanic's 60 s response timeout would cut it off.
    app.config.RESPONSE_TIMEOUT = 24 * 3600
    app.config.REQUEST_TIMEOUT = 600
    app.config.KEEP_ALIVE_TIMEOUT = 30
    app.config.FALLBACK_ERROR_FORMAT = "json"
    # Sanic answers 413 (through on_error) from the Content-Length or while reading, before any handler runs.
    app.config.REQUEST_MAX_SIZE = serving.limits.max_request_bytes
    app.ctx.serving = serving
    add_webui_routes(app)  # the chat page at /

    @app.on_request
    async def check_key(request: Request) -> HTTPResponse | None:
        if api_key is None or not request.path.startswith(_PROTECTED):
            return None
        header = request.headers.get("authorization", "")
        token = header[7:] if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            return error_response(APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                           None, "invalid_api_key"))
        return None

    @app.exception(Exception)
    async def on_error(request: Request, exc: Exception) -> HTTPResponse:
        if isinstance(exc, APIError):
            return error_response(exc)
        if isinstance(exc, SanicException):  # unknown route, wrong method, body too large, ...
            status = exc.status_code or 500
            return error_response(APIError(status, str(exc) or exc.__class__.__name__))
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, f"internal error: {exc.__class__.__name__}: {exc}"))

    @app.get("/health")
    async def health(request: Request) -> HTTPResponse:
        engine = serving.engine
        if not engine.alive:
            return error_response(APIError(503, f"the engine is not running: {engine.dead or 'its thread ended'}",
                                           None, "engine_dead"))
        return json({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> HTTPResponse:
        return raw(serving.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi(request: Request) -> HTTPResponse:
        return json(openapi_document(serving.model.id))

    def card() -> dict:
        m = serving.model
        return {"id": m.id, "object": "model", "created": m.created, "owned_by": "llm-engine", "root": m.id,
                "max_model_len": m.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> HTTPResponse:
        return json({"object": "list", "data": [card()]})

    @app.get("/v1/models/<model_id:path>")
    async def model(request: Request, model_id: str) -> HTTPResponse:
        serving.check_model(model_id)
        return json(card())

    def streamer(request: Request):
        async def open_stream():
            response = await request.respond(content_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return response.send
        return open_stream

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> HTTPResponse | None:
        body = await serving.chat(parse(ChatCompletionRequest, request), streamer(request))
        return None if body is None else json(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> HTTPResponse | None:
        body = await serving.completion(parse(CompletionRequest, request), streamer(request))
        return None if body is None else json(body)

    @app.post("/v1/embeddings")
    async def embed(request: Request) -> HTTPResponse:
        return json(await embeddings(serving, parse(EmbeddingRequest, request)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> HTTPResponse:
        req = parse(TokenizeRequest, request)
        serving.check_model(req.model)
        tok = serving.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = await off_loop(serving.chat_prompt, req)
        else:
            serving.limits.check_chars([req.prompt], "prompt")
            ids = (await off_loop(encode_texts, tok, [req.prompt], req.add_special_tokens))[0]
        return json({"tokens": ids, "count": len(ids), "max_model_len": serving.model.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> HTTPResponse:
        req = parse(DetokenizeRequest, request)
        serving.check_model(req.model)
        if serving.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in req.tokens if t >= serving.model.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is not below the vocabulary size {serving.model.vocab_size}",
                           "tokens")
        return json({"prompt": serving.tokenizer.decode(req.tokens)})

    return app
