"""The load tools/bench_serving puts on a server: streamed OpenAI requests, each timed chunk by chunk, sent at a
fixed concurrency or as a Poisson process, over one async HTTP client (httpx2, which openai 3 brings; or httpx)."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import queue
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from tools.bench_serving_data import BenchPrompt

try:
    import httpx2 as httpx
except ImportError:  # openai 1.x brings httpx itself
    import httpx

__all__ = ["RequestResult", "Target", "run_load"]


@dataclass
class Target:
    """Where requests go and what they ask for."""

    base_url: str  # up to the server's root: http://host:port (a trailing /v1 is taken off)
    model: str
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True  # an extra body field (ours, vLLM, llama-server): outputs of exactly max_tokens
    min_tokens: bool = False  # also min_tokens = max_tokens, for servers that know that field instead
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/").removesuffix("/v1")
        return root + ("/v1/chat/completions" if self.chat else "/v1/completions")

    def body(self, p: BenchPrompt) -> dict:
        body = {"model": self.model, "max_tokens": p.output_len, "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.chat:
            text = p.prompt if isinstance(p.prompt, str) else None
            if text is None:
                raise ValueError("chat requests need text prompts (--random-text or --dataset)")
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = p.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.min_tokens:
            body["min_tokens"] = p.output_len
        return {**body, **self.extra_body}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0  # the server's usage, else our count
    output_tokens: int = 0  # the server's usage, else the chunks that carried tokens
    ttft_s: float = 0.0  # to the first chunk that carries a token (its text may be held back: empty)
    e2e_s: float = 0.0  # to the end of the stream
    itl_s: list[float] = field(default_factory=list)  # between consecutive chunks that carry tokens
    usage_reported: bool = False
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a single token."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _chunk_text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def sse_lines(chunks):
    """The lines of an event stream, split where SSE splits them (LF, CRLF or CR) and nowhere else: httpx's
    aiter_lines follows str.splitlines, which also breaks at U+2028, U+0085, \x1c-\x1e and the like, characters
    that a JSON event's text may hold unescaped (random token ids decode to them)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buf:
        yield buf.decode("utf-8", errors="replace")


async def send_one(client: httpx.AsyncClient, target: Target, p: BenchPrompt) -> RequestResult:
    """One streamed request, timed at each server-sent event."""
    res = RequestResult(prompt_tokens=p.input_len)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    pieces: list[str] = []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", target.url, json=target.body(p), headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
                return res
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                if chunk.get("usage"):
                    res.usage_reported = True
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices") or ():
                    text = _chunk_text(choice, target.chat)
                    if not text and (choice.get("finish_reason") is not None or
                                     (target.chat and (choice.get("delta") or {}).get("role"))):
                        continue  # a role-only first chunk, or a final one with only finish_reason
                    # else a token's chunk, its text maybe held back (ours and vLLM send those; llama-server does
                    # not, so there a gap after such a token spans two)
                    if not pieces:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    pieces.append(text)
        res.e2e_s = time.perf_counter() - start
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{e.__class__.__name__}: {e}"
        return res
    res.text = "".join(pieces)
    if not res.usage_reported:
        res.output_tokens = len(pieces)
    res.ok = bool(pieces)
    if not res.ok:
        res.error = "the stream carried no text"
    return res


async def _run(target: Target, prompts: list[BenchPrompt], concurrency: int | None, rate: float, seed: int,
               progress: bool, desc: str = "") -> tuple[list[RequestResult], float, float]:
    limit = concurrency or len(prompts)
    client = httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s),
                               limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))
    gate = asyncio.Semaphore(limit)
    gaps = np.random.default_rng(seed).exponential(1 / rate, len(prompts)) if math.isfinite(rate) else None
    bar = tqdm(total=len(prompts), desc=desc or f"concurrency {concurrency or '-'}, rate {rate:g}/s", unit="req",
               disable=not progress, leave=False)

    async def one(p: BenchPrompt) -> RequestResult:
        async with gate:
            res = await send_one(client, target, p)
        bar.update(1)
        return res

    async with client:
        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one(p)))
            if gaps is not None and i + 1 < len(prompts):
                await asyncio.sleep(gaps[i])  # Poisson arrivals: exponential gaps
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
    bar.close()
    return list(results), start, end


def _client_proc(k: int, barrier, out, target, prompts, concurrency, rate, seed, progress, desc) -> None:
    barrier.wait()  # every client starts together: the run's wall time spans them all
    out.put((k, *asyncio.run(_run(target, prompts, concurrency, rate, seed, progress, desc))))


def run_load(target: Target, prompts: list[BenchPrompt], concurrency: int | None = None, rate: float = math.inf,
             seed: int = 0, progress: bool = True, procs: int = 1) -> tuple[list[RequestResult], float]:
    """Every prompt once: at most `concurrency` in flight (None: no bound), arriving at `rate` a second (inf: all at
    once). Returns each request's result, in prompt order, and the wall time of the whole run.

    procs > 1 shares the load out over that many client processes (prompts round-robin, concurrency and rate
    divided): one Python process parses some 20-40 us a streamed event, so at tens of thousands of tokens a second
    a single client would measure itself rather than the server."""
    procs = max(1, min(procs, len(prompts), concurrency or len(prompts)))
    if procs == 1:
        results, start, end = asyncio.run(_run(target, prompts, concurrency, rate, seed, progress))
        return results, end - start
    ctx = multiprocessing.get_context("spawn")  # the caller may hold a CUDA context (--offline): no fork
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_client_proc, daemon=True,
                           args=(k, barrier, out, target, prompts[k::procs],
                                 None if concurrency is None else concurrency // procs + (k < concurrency % procs),
                                 rate / procs, seed + k, progress and k == 0,
                                 f"concurrency {concurrency or '-'}, rate {rate:g}/s, client 1 of {procs}"))
               for k in range(procs)]
    for w in workers:
        w.start()
    parts = []
    while len(parts) < procs:
        try:
            parts.append(out.get(timeout=1.0))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise RuntimeError("a client process failed (its traceback is above)") from None
    parts.sort(key=lambda p: p[0])
    for w in workers:
        w.join()
    merged: list[RequestResult] = [None] * len(prompts)  # type: ignore[list-item]
    for k, results, _, _ in parts:
        merged[k::procs] = results
    return merged, max(p[3] for p in parts) - min(p[2] for p in parts)


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 30) -> str:
    """The first model GET /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


ENGINE_COUNTERS = {"steps": "llm_engine:engine_steps_total", "generated": "llm_engine:generation_tokens_total",
                   "prefilled": "llm_engine:prompt_tokens_total"}


def engine_counters(base_url: str, timeout_s: float = 10) -> dict[str, float] | None:
    """Our server's step and token counters from GET /metrics (Prometheus text), or None where a server has no such
    counters (llama-server, vLLM): a level's difference says how many steps the engine ran for its tokens."""
    try:
        r = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    got = {}
    for line in r.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in ENGINE_COUNTERS.items():
            if name == metric:
                got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return got if len(got) == len(ENGINE_COUNTERS) else None
