"""The messages between the API process and the engine process, in msgpack through msgspec.

One message each way per turn: the API sends every add and abort of one event-loop pass together (`Inputs`), the
engine answers each step with one `Step` carrying the outputs of all its requests, the failures, the stats the
metrics read, and how many of the API's adds it has taken (so that the admission counts never miss a request in
transit). Outputs are deltas (new text, new ids, new logprobs): a full report every step would grow with each token.
"""

from __future__ import annotations

import msgspec
import numpy as np

from core.sampling_params import SamplingParams
from frontend.engine.engine import LLMEngine
from frontend.engine.outputs import CompletionOutput, RequestOutput, TokenView
from frontend.engine.sequence import TokenLogprob
from ir.pooling import Pooling

Logprob = tuple[int, float, list[tuple[int, float]] | None]  # token, its logprob, the top (id, logprob) pairs


class Add(msgspec.Struct, array_like=True):
    request_id: str
    n: int  # its sequences, in the clear: the admission counts need them even if the rest cannot be decoded
    # Decoded apart on the engine side: a malformed prompt or parameters fails this request, not the whole message.
    prompt: msgspec.Raw
    params: msgspec.Raw


class Inputs(msgspec.Struct, array_like=True):
    adds: list[Add] = []
    aborts: list[str] = []
    stop: bool = False


class EngineStats(msgspec.Struct, array_like=True):
    running: int = 0  # sequences in the running batch
    waiting_seqs: int = 0
    waiting_requests: int = 0  # an n > 1 request counts once
    free_blocks: int = 0
    total_blocks: int = 1
    prompt_tokens: int = 0  # cumulative, since the engine started
    generation_tokens: int = 0
    steps: int = 0


class SeqDelta(msgspec.Struct, array_like=True):
    index: int
    text: str  # new since the last report
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[Logprob] | None  # None: the request asked for none


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    outputs: list[SeqDelta]
    finished: bool
    num_cached_tokens: int
    error: str | None
    embedding: bytes | None = None  # an embedding model's vector: little-endian float32


class Failure(msgspec.Struct, array_like=True):
    request_id: str
    kind: str  # "refused" (the engine's own checks: a 400), "failed" (could not be added), "step_failed"
    message: str


class Ready(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    vocab_size: int
    max_model_len: int
    num_blocks: int  # in every KV group's pool together
    block_size: int
    kv_tokens: int  # the longest sequence the KV cache holds (RequestBounds.kv_tokens)
    pooling: Pooling | None = None  # an embedding model's (ir.pooling): the API serves /v1/embeddings alone


class LoadFailed(msgspec.Struct, tag="load_failed", array_like=True):
    message: str


class Step(msgspec.Struct, tag="step", array_like=True):
    outputs: list[RequestDelta]
    failures: list[Failure]
    stats: EngineStats
    added_requests: int  # adds taken from the API's messages since the last Step (refused ones too)
    added_seqs: int


class Dead(msgspec.Struct, tag="dead", array_like=True):
    message: str


FromEngine = Ready | LoadFailed | Step | Dead


def stats_of(engine: LLMEngine) -> EngineStats:
    waiting = tuple(engine.scheduler.waiting)  # one C call: the engine thread cannot interleave (in-process mode)
    return EngineStats(len(engine.scheduler.running), len(waiting), len({s.request_id for s in waiting}),
                       engine.blocks.num_free_blocks, engine.blocks.num_blocks, engine.stats["prompt_tokens"],
                       engine.stats["generation_tokens"], engine.stats["steps"])


def delta_of(out: RequestOutput) -> RequestDelta:
    """The engine's report as what changed since the last one."""
    seqs = []
    for c in out.outputs:
        lp = None
        if c.logprobs is not None:
            end = c.num_tokens  # not len(c.token_ids): that would copy the whole list
            lp = [(e.token, e.logprob, e.top) for e in c.logprobs[end - len(c.delta_token_ids):end]]
        seqs.append(SeqDelta(c.index, c.delta_text, c.delta_token_ids, c.finish_reason, c.stop_reason, lp))
    vec = None if out.embedding is None else out.embedding.astype("<f4").tobytes()
    return RequestDelta(out.request_id, seqs, out.finished, out.num_cached_tokens, out.error, vec)


class RequestState:
    """The API side of one request: the deltas added up into the RequestOutput that serving.py reads, in O(new
    tokens) a step like the engine's own reports (frontend/engine/outputs.py): each choice's token list and text
    pieces are only appended to, and each report views them up to its own lengths."""

    __slots__ = ("request_id", "prompt", "seqs")

    def __init__(self, request_id: str, prompt: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.seqs: dict[int, tuple[list[str], list[int], list[TokenLogprob] | None, list[int]]] = {}

    def apply(self, delta: RequestDelta) -> RequestOutput:
        outs = []
        for d in delta.outputs:
            pieces, ids, lps, text_len = self.seqs.setdefault(d.index, ([], [], None, [0]))
            if d.text:
                pieces.append(d.text)
                text_len[0] += len(d.text)
            ids.extend(d.token_ids)
            if d.logprobs is not None:
                if lps is None:
                    lps = []  # only appended to: readers slice it by token counts
                    self.seqs[d.index] = (pieces, ids, lps, text_len)
                lps.extend(TokenLogprob(t, lp, top) for t, lp, top in d.logprobs)
            outs.append(CompletionOutput(d.index, pieces, len(pieces), text_len[0], TokenView(ids, len(ids)),
                                         d.finish_reason, d.stop_reason, lps, d.text, d.token_ids))
        vec = None if delta.embedding is None else np.frombuffer(delta.embedding, "<f4")
        return RequestOutput(self.request_id, self.prompt, outs, delta.finished, delta.num_cached_tokens,
                             delta.error, vec)


class Codec:
    """One encoder and the decoders of each direction, reused (msgspec's are cheapest kept)."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.inputs = msgspec.msgpack.Decoder(Inputs)
        self.from_engine = msgspec.msgpack.Decoder(FromEngine)
        self.prompt = msgspec.msgpack.Decoder(list[int])
        self.params = msgspec.msgpack.Decoder(SamplingParams)

    def encode(self, msg) -> bytes:
        return self.encoder.encode(msg)

    def raw(self, value) -> msgspec.Raw:
        return msgspec.Raw(self.encoder.encode(value))
