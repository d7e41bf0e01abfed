"""A sequence: one prompt and one stream of generated tokens, with its place in the KV cache."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from frontend.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n choices
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: np.random.Generator
    detokenizer: object | None = None  # IncrementalDetokenizer
    parent: Sequence | None = None  # an n>1 sibling waits for its parent's prefill, then shares its blocks
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # of full blocks, chained
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    text_offset: int = 0  # how much of the detokenized text has been reported
    # Overlapped steps: the last `pending` output tokens are placeholders (-1) for tokens sampled on the device and
    # not read back yet; the newest was row `chain_row` of the step that sampled it.
    pending: int = 0
    chain_row: int = -1
    needs_history: bool = False  # its sampling reads its tokens (penalties): never sampled blind
    min_tokens_params: SamplingParams | None = None  # params with the stop tokens banned, while under min_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if start >= p:  # a decode step: no copy of the whole history
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefilled(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)
