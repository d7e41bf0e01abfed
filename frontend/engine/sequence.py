"""A sequence: one prompt and one stream of generated tokens, with its place in the KV cache."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from core.kv_layout import NULL_BLOCK
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


@dataclass(eq=False)
class GroupBlocks:
    """A sequence's blocks in one KV group's pool (core.kv_layout): its block table, positional (entry i holds cache
    indices i * block_size ..), and what the block manager knows of it."""

    table: list[int] = field(default_factory=list)
    num_committed: int = 0  # leading entries known to carry their hash (BlockManager.commit)
    num_freed: int = 0  # leading entries let go (out of every future query's window): they hold the null block
    # array()'s mirror of table: which list it mirrors, how many of its entries, how many of those nulled since
    _arr: np.ndarray | None = field(default=None, repr=False)
    _of: list[int] | None = field(default=None, repr=False)
    _len: int = field(default=0, repr=False)
    _freed: int = field(default=0, repr=False)

    def array(self) -> np.ndarray:
        """The table as int32, mirrored incrementally: a step then copies each table at memcpy speed instead of
        converting every Python int of it (a long sequence holds hundreds of blocks). The block manager only ever
        appends to a table, nulls its leading entries, or replaces it with a new list, which is what the mirror
        relies on."""
        table, arr, n = self.table, self._arr, len(self.table)
        if self._of is not table or n < self._len:  # a new table (freed, or set by a test)
            arr, self._of, self._len, self._freed = np.empty(max(n, 16), np.int32), table, 0, 0
        elif n > len(arr):
            arr = np.concatenate([arr, np.empty(max(n, 2 * len(arr)) - len(arr), np.int32)])
        if n > self._len:
            arr[self._len:n] = table[self._len:]
            self._len = n
        if self.num_freed > self._freed:
            arr[self._freed:self.num_freed] = NULL_BLOCK
            self._freed = self.num_freed
        self._arr = arr
        return arr[:n]


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
    kv: list[GroupBlocks] = field(default_factory=lambda: [GroupBlocks()])  # its blocks in each KV group
    block_hashes: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # of full blocks, chained
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
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
    grammar: object | None = None  # a structured output's matcher (token_masks), advanced by each token read back
    token_mask: np.ndarray | None = None  # its allowed tokens for the step being sampled (core.sampler)

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

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table (a one-group model's only one)."""
        return self.kv[0].table

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.kv[0].table = table

    def block_array(self) -> np.ndarray:
        """Group 0's block table as int32 (GroupBlocks.array)."""
        return self.kv[0].array()

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefilled(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)
