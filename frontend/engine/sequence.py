"""A sequence: one prompt and one stream of generated tokens, with its place in the KV cache."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from core.sampler import TokenHistory


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
    num_committed_blocks: int = 0  # leading blocks of block_table known to carry their hash (BlockManager.commit)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    reported_pieces: int = 0  # how many of the detokenizer's text pieces have been reported
    # Overlapped steps: the last `pending` output tokens are placeholders (-1) for tokens sampled on the device and
    # not read back yet; the newest was row `chain_row` of the step that sampled it.
    pending: int = 0
    chain_row: int = -1
    needs_history: bool = False  # its sampling reads its tokens (penalties): never sampled blind
    history: TokenHistory | None = None  # then its tokens' counts, kept as they come
    min_tokens_params: SamplingParams | None = None  # params with the stop tokens banned, while under min_tokens
    # block_array's mirror of block_table: which list it mirrors, and how many of its entries
    _blocks: np.ndarray | None = field(default=None, repr=False)
    _blocks_of: list[int] | None = field(default=None, repr=False)
    _blocks_len: int = field(default=0, repr=False)

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
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def block_array(self) -> np.ndarray:
        """block_table as int32, mirrored incrementally: a step then copies each table at memcpy speed instead of
        converting every Python int of it (a long sequence holds hundreds of blocks). The block manager only ever
        appends to a table or replaces it with a new list, which is what the mirror relies on."""
        table, arr, n = self.block_table, self._blocks, len(self.block_table)
        if self._blocks_of is not table or n < self._blocks_len:  # a new table (freed, or set by a test)
            arr, self._blocks_of, self._blocks_len = np.empty(max(n, 16), np.int32), table, 0
        elif n > len(arr):
            arr = np.concatenate([arr, np.empty(max(n, 2 * len(arr)) - len(arr), np.int32)])
        if n > self._blocks_len:
            arr[self._blocks_len:n] = table[self._blocks_len:]
            self._blocks_len = n
        self._blocks = arr
        return arr[:n]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefilled(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)
