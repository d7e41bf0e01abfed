"""What a step reports: each request's outputs, built in O(new tokens) however long the output already is.

A report names its sequence's token list and text pieces up to their current lengths instead of copying them:
both only grow (the tokens before a sequence's placeholders never change, text pieces are only appended), so
the full `token_ids` and `text` are the same whenever they are read, and a reader that wants only the deltas (a
stream) never pays for the whole history. The first read of either builds it once for that report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CompletionOutput", "RequestOutput", "TokenView", "merge_outputs"]


class TokenView:
    """The first `n` items of an append-only list, without copying it: len, slices and iteration."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[int], n: int):
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._items[slice(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError("token index out of range")
        return self._items[i % self._n]

    def __iter__(self):
        return iter(self._items[:self._n])

    def list(self) -> list[int]:
        return self._items[:self._n]


class CompletionOutput:
    """One choice after a step: the deltas since the last report, and (built when first read) everything so far."""

    __slots__ = ("index", "finish_reason", "stop_reason", "logprobs", "delta_text", "delta_token_ids", "token_view",
                 "text_len", "_pieces", "_num_pieces", "_text", "_token_ids")

    def __init__(self, index: int, pieces: list[str], num_pieces: int, text_len: int, token_view: TokenView,
                 finish_reason: str | None, stop_reason: str | int | None, logprobs: list | None, delta_text: str,
                 delta_token_ids: list[int]):
        """The text is the first `num_pieces` of `pieces` (`text_len` characters), the tokens `token_view`."""
        self.index, self.finish_reason, self.stop_reason = index, finish_reason, stop_reason
        self.logprobs = logprobs  # the sequence's own list, still growing: the first num_tokens are this report's
        self.delta_text, self.delta_token_ids = delta_text, delta_token_ids
        self.token_view, self.text_len = token_view, text_len
        self._pieces, self._num_pieces = pieces, num_pieces
        self._text: str | None = None
        self._token_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_view)

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._token_ids = self.token_view.list()
        return self._token_ids

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(self._pieces[:self._num_pieces])
        return self._text

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # the request failed (its sampling raised): finished, with this message
    embedding: np.ndarray | None = None  # an embedding model's pooled vector (float32), once finished


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two successive reports of one request as one: `then`'s with each choice's deltas prefixed by `first`'s (a
    stream that fell behind sends them in one chunk). Choices only `first` reports keep its report."""
    outs = {c.index: c for c in first.outputs}
    for c in then.outputs:
        a = outs.get(c.index)  # a report names each choice once, so this is still first's
        outs[c.index] = c if a is None else CompletionOutput(
            c.index, c._pieces, c._num_pieces, c.text_len, c.token_view, c.finish_reason, c.stop_reason, c.logprobs,
            a.delta_text + c.delta_text, a.delta_token_ids + c.delta_token_ids)
    return RequestOutput(then.request_id, then.prompt_token_ids, [outs[i] for i in sorted(outs)], then.finished,
                         then.num_cached_tokens, then.error, then.embedding)
