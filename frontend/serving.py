"""Chat and text completions: request -> prompt ids and SamplingParams -> engine -> OpenAI body or SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput
from frontend.chat_output import ChoiceReader, OutputParsing, ParserChoice
from frontend.engine.engine import CompletionOutput, RequestOutput
from frontend.engine_errors import EngineDeadError, RequestFailedError, StepFailedError
from frontend.errors import APIError, bad_request
from frontend.limits import ServingLimits, token_id_key
from frontend.logprobs import LogprobFormatter, context_ids
from frontend.metrics import Metrics
from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    ServerDefaults,
    TokenizeRequest,
    sampling_params,
)
from frontend.responses import Reply, chat_choice, chat_delta, parsed_choice, parsed_delta, sse, text_choice
from frontend.structured_request import request_constraint
from frontend.tools import check_tools, template_kwargs, template_messages, tool_constraint, tool_params
from ir.pooling import Pooling

if TYPE_CHECKING:
    from frontend.async_engine import AsyncEngine
    from frontend.engine_proc.client import EngineClient

log = logging.getLogger(__name__)
Send = Callable[[str], Awaitable[None]]
# Tokenization and template rendering run here, off the event loop, so that a long prompt never stalls the streams.
_TOKENIZE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


async def off_loop(fn: Callable, *args):
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE, fn, *args)


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """tokenizer.encode for each text, through the `tokenizers` batch call, which releases the GIL (encode holds it)."""
    backend = getattr(tokenizer, "backend", None)
    if hasattr(backend, "encode_batch"):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


@dataclass
class ServedModel:
    id: str
    max_model_len: int
    vocab_size: int
    created: int
    kv_tokens: int | None = None  # what the KV cache holds: one sequence can never grow past it
    pooling: Pooling | None = None  # an embedding model's (ir.pooling): it serves /v1/embeddings alone


class OpenAIServing:
    def __init__(self, engine: AsyncEngine | EngineClient, metrics: Metrics, tokenizer, model: ServedModel,
                 defaults: ServerDefaults, max_waiting: int, limits: ServingLimits | None = None,
                 parsers: ParserChoice | None = None):
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model = model
        self.defaults = defaults
        self.max_waiting = max_waiting
        self.limits = limits or ServingLimits()
        self.logprobs = LogprobFormatter(tokenizer)
        self.parsers = parsers or ParserChoice.resolve("auto", "auto", getattr(tokenizer, "chat_template", None))

    # -- shared checks ------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model.id!r}",
                           "model", "model_not_found")

    def _max_tokens(self, asked: int | None, prompt_len: int, param: str, prompt_param: str) -> int:
        limit = self.model.max_model_len
        if asked is None:  # the default: what the context (and the KV cache) leaves
            room = min(limit, self.model.kv_tokens or limit) - prompt_len
            if room < 1:
                raise bad_request(f"this model's maximum context length is {limit} tokens and the prompt has "
                                  f"{prompt_len}: no room is left to generate", prompt_param, "context_length_exceeded")
            return min(room, self.defaults.max_gen_tokens or room)
        if prompt_len + asked > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
                              f"tokens and {param} asks for {asked} more ({prompt_len + asked} in all)", param,
                              "context_length_exceeded")
        return asked

    def _params(self, req: SamplingFields, prompts: list[list[int]], asked: int | None, param: str,
                logprobs: int | None, tool: StructuredOutput | None = None) -> SamplingParams:
        if req.logit_bias:
            for key in req.logit_bias:
                if not token_id_key(key) or not 0 <= int(key) < self.model.vocab_size:
                    raise bad_request(f"logit_bias keys must be token ids below {self.model.vocab_size}, got {key!r}",
                                      "logit_bias")
        bad = [t for t in req.stop_token_ids or () if t >= self.model.vocab_size]
        if bad:
            raise bad_request(f"stop_token_ids: {bad[0]} is not below the vocabulary size {self.model.vocab_size}",
                              "stop_token_ids")
        # several prompts share one SamplingParams: without max_tokens, each gets what the longest one leaves
        prompt_param = "prompt" if isinstance(req, CompletionRequest) else "messages"
        max_tokens = min(self._max_tokens(asked, len(p), param, prompt_param) for p in prompts)
        try:
            params = sampling_params(req, self.defaults, max_tokens, logprobs)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None
        params.structured = request_constraint(req, tool)  # compiled (and cached) here: a bad one is a 400
        for p in prompts:
            try:
                self.engine.check(p, params)
            except ValueError as e:
                raise bad_request(str(e), prompt_param) from None
        # One engine request per prompt, n sequences each: requests and sequences are bounded apart.
        self.limits.check_waiting(self.engine.num_waiting(), self.engine.num_waiting_seqs(), len(prompts),
                                  len(prompts) * params.n, self.max_waiting)
        return params

    def _check_request(self, req: SamplingFields) -> None:
        """The limits and OpenAI's rules that need no tokenizer: checked before any tokenization."""
        self.check_model(req.model)
        if self.model.pooling is not None:
            raise bad_request(f"{self.model.id} is an embedding model (no LM head): it generates no text; use "
                              "/v1/embeddings", "model")
        self.limits.check_sampling(req)
        if req.prompt_logprobs is not None:  # a client relying on them must not get a reply without them
            raise bad_request("prompt_logprobs is not supported: this server returns logprobs of generated tokens "
                              "only", "prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    # -- chat ---------------------------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        return self.chat_inputs(req)[1]

    def chat_inputs(self, req: ChatCompletionRequest | TokenizeRequest) -> tuple[str, list[int]]:
        """The rendered template and its ids."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        check_tools(req.tools, getattr(req, "tool_choice", None))
        self.limits.check_messages(req.messages)
        messages = template_messages(req.messages)
        generation_prompt = req.add_generation_prompt
        if req.continue_final_message:  # vLLM refuses both asked for; the default true gives way
            if generation_prompt and "add_generation_prompt" in req.model_fields_set:
                raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                                  "continue_final_message")
            generation_prompt = False
        try:
            text = self.tokenizer.render_chat(messages, generation_prompt,
                                              continue_final_message=req.continue_final_message, **template_kwargs(req))
        except Exception as e:  # a template's raise_exception() (roles must alternate, ...) is the client's problem
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
        # as apply_chat_template: the template writes the special tokens itself
        return text, encode_texts(self.tokenizer, [text], add_special_tokens=False)[0]

    async def chat(self, req: ChatCompletionRequest, stream: Callable[[], Awaitable[Send]]) -> dict | None:
        self._check_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        text, prompt = await off_loop(self.chat_inputs, req)
        asked, param = (req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens else \
            (req.max_tokens, "max_tokens")
        top = req.top_logprobs or 0
        params = self._params(req, [prompt], asked, param, top if req.logprobs else None, tool_constraint(req))
        parsing = self.parsers.for_request(req, text)
        tool_params(req, params, parsing)
        reply = Reply("chat", self.model.id, prompt_tokens=len(prompt))
        if req.stream:
            await self._stream(reply, [prompt], params, await stream(),
                               self._chat_chunks(params, top, prompt, parsing),
                               req.stream_options and req.stream_options.include_usage)
            return None
        outs = await self._collect([prompt], params, reply)
        context = context_ids(prompt, [], 0)
        choices = []
        for c in outs[0].outputs:
            lp = self.logprobs.chat(c.logprobs, top, context) if req.logprobs else None
            choices.append(chat_choice(c.index, c, lp) if parsing is None else
                           parsed_choice(c.index, *parsing.message(c.text, c.finish_reason), c.stop_reason, lp))
        return reply.body(choices)

    def _chat_chunks(self, params: SamplingParams, top: int, prompt: list[int], parsing: OutputParsing | None):
        readers: dict[int, ChoiceReader] = {}  # a choice's own parser state, for n > 1

        def chunks(_: int, c: CompletionOutput, first: bool, last: bool) -> list[dict[str, Any]]:
            new = _new_logprobs(c, params)
            start = c.num_tokens - len(c.delta_token_ids)
            lp = self.logprobs.chat(new, top, context_ids(prompt, c.token_view, start)) if new else None
            out = [chat_delta(c.index, "", None, None, role=True)] if first else []
            if parsing is not None:
                reader = readers.get(c.index) or readers.setdefault(c.index, parsing.reader())
                deltas = reader.feed(c.delta_text, last) or ([{}] if lp or last else [])
                for k, delta in enumerate(deltas):
                    end = last and k == len(deltas) - 1
                    out.append(parsed_delta(c.index, delta, lp if k == 0 else None,
                                            reader.finish_reason(c.finish_reason) if end else None, c.stop_reason))
            elif c.delta_text or lp or last or c.delta_token_ids:  # a token whose text is held back: a chunk still
                out.append(chat_delta(c.index, c.delta_text, lp, c.finish_reason if last else None,
                                      c.stop_reason))
            return out
        return chunks

    # -- text completions ---------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n when given", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (it needs prompt logprobs)", "echo")
        p = req.prompt
        texts = [p] if isinstance(p, str) else [x for x in p if isinstance(x, str)]
        count = 1 if isinstance(p, str) or isinstance(p[0], int) else len(p)
        self.limits.check_prompts(count, req.n, texts)
        if texts:
            if self.tokenizer is None:
                raise bad_request("this model has no tokenizer: send token ids", "prompt")
            return encode_texts(self.tokenizer, texts)
        return [list(p)] if isinstance(p[0], int) else [list(x) for x in p]

    async def completion(self, req: CompletionRequest, stream: Callable[[], Awaitable[Send]]) -> dict | None:
        self._check_request(req)
        # an empty prompt is refused by the engine's check in _params
        prompts = await off_loop(self.completion_prompts, req)
        params = self._params(req, prompts, req.max_tokens, "max_tokens", req.logprobs)
        reply = Reply("text", self.model.id, prompt_tokens=sum(len(p) for p in prompts))
        echo = [self._echo(p) if req.echo else "" for p in prompts]
        if req.stream:
            await self._stream(reply, prompts, params, await stream(), self._text_chunks(params, echo, prompts),
                               req.stream_options and req.stream_options.include_usage)
            return None
        outs = await self._collect(prompts, params, reply)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                lp = None if params.logprobs is None else \
                    self.logprobs.text(c.logprobs, len(echo[i]), context_ids(prompts[i], [], 0))
                choices.append(text_choice(i * params.n + c.index, echo[i] + c.text, lp, c.finish_reason,
                                           c.stop_reason))
        return reply.body(choices)

    def _echo(self, prompt: list[int]) -> str:
        return self.tokenizer.decode(prompt) if self.tokenizer else ""

    def _text_chunks(self, params: SamplingParams, echo: list[str], prompts: list[list[int]]):
        def chunks(i: int, c: CompletionOutput, first: bool, last: bool) -> list[dict[str, Any]]:
            new = _new_logprobs(c, params)
            start = c.num_tokens - len(c.delta_token_ids)
            lp = (self.logprobs.text(new, c.text_len - len(c.delta_text), context_ids(prompts[i], c.token_view, start))
                  if new else None)
            text = (echo[i] if first else "") + c.delta_text
            # A token whose text is held back (part of a UTF-8 character, a possible stop string's start) still gets
            # its chunk, with empty text, as vLLM sends it: a client sees each step, and a gap is one token's.
            if not (text or lp or last or c.delta_token_ids):
                return []
            return [text_choice(i * params.n + c.index, text, lp, c.finish_reason if last else None, c.stop_reason)]
        return chunks

    # -- running requests ---------------------------------------------------------------------------
    async def _collect(self, prompts: list[list[int]], params: SamplingParams, reply: Reply) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async for i, out in self._generate(prompts, params, reply):
            if out.finished:
                final[i] = out
        return [final[i] for i in range(len(prompts))]

    async def _stream(self, reply: Reply, prompts: list[list[int]], params: SamplingParams, send: Send,
                      chunks, include_usage: bool | None) -> None:
        usage_field = False if include_usage else None
        seen: set[tuple[int, int]] = set()
        done: set[tuple[int, int]] = set()
        try:
            async for i, out in self._generate(prompts, params, reply):
                choices = []
                for c in out.outputs:
                    key = (i, c.index)
                    if key in done:
                        continue  # an n > 1 request reports every sibling; one that ended has said so
                    last = c.finish_reason is not None
                    choices += chunks(i, c, key not in seen, last)
                    seen.add(key)
                    if last:
                        done.add(key)
                for choice in choices:  # one choice an event, as vLLM does
                    await send(reply.chunk([choice], usage_field))
            if include_usage:
                await send(reply.chunk([], True))
        except (APIError, RuntimeError, ValueError) as e:
            status = e.status if isinstance(e, APIError) else 500
            body = APIError(status, str(e)).body()
            log.warning("stream %s ended with an error: %s", reply.id, e)
            await send(sse(body))
        await send(sse("[DONE]"))

    async def _generate(self, prompts: list[list[int]], params: SamplingParams,
                        reply: Reply) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs every prompt as its own engine request and merges their outputs; leaving early aborts them all."""
        arrival, first_token, remaining = time.monotonic(), None, len(prompts)
        try:
            async with contextlib.aclosing(self._outputs(prompts, params)) as outs:
                async for i, item in outs:
                    if first_token is None and any(c.delta_token_ids for c in item.outputs):
                        first_token = time.monotonic()
                        self.metrics.ttft.observe(first_token - arrival)
                    if item.finished:
                        remaining -= 1
                        self._finished(item, reply, arrival, first_token)
                    yield i, item
        finally:
            for _ in range(remaining * params.n):  # the client went away (or the engine failed) first
                self.metrics.finished("abort")

    async def _outputs(self, prompts: list[list[int]],
                       params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, engine failures as API errors. One prompt (the usual request) is read
        straight from its stream, closed at once when this ends early (the request aborted, its KV blocks freed,
        without waiting for the loop's generator finalizer); several each get a task feeding one queue."""
        if len(prompts) == 1:
            try:
                async with contextlib.aclosing(self.engine.generate(prompts[0], params)) as outs:
                    async for item in outs:
                        yield 0, item
            except Exception as e:
                err = _api_error(e)
                if err is e:
                    raise
                raise err from e
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt: list[int]) -> None:
            try:
                async for out in self.engine.generate(prompt, params):
                    queue.put_nowait((i, out))
            except Exception as e:  # handed to the consumer, which raises it in the handler
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        remaining = len(prompts)
        try:
            while remaining:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise _api_error(item)
                remaining -= item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def _finished(self, out: RequestOutput, reply: Reply, arrival: float, first_token: float | None) -> None:
        now = time.monotonic()
        reply.completion_tokens += sum(c.num_tokens for c in out.outputs)
        reply.cached_tokens += out.num_cached_tokens
        self.metrics.e2e.observe(now - arrival)
        n = max(c.num_tokens for c in out.outputs)
        if first_token is not None and n > 1:
            self.metrics.tpot.observe((now - first_token) / (n - 1))
        for c in out.outputs:
            self.metrics.finished(c.finish_reason)


def _api_error(e: Exception) -> Exception:
    """An engine-side failure as the OpenAI error the client gets."""
    if isinstance(e, ValueError):
        return bad_request(str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), None, "engine_unavailable")
    if isinstance(e, RequestFailedError | StepFailedError):
        return APIError(500, str(e), None, "request_failed")
    return e


def _new_logprobs(c: CompletionOutput, params: SamplingParams) -> list:
    """The logprobs of the tokens new in this report (the engine's list is the whole sequence's, still growing)."""
    if params.logprobs is None or not c.delta_token_ids:
        return []
    return c.logprobs[c.num_tokens - len(c.delta_token_ids):c.num_tokens]
