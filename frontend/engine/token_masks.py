"""Structured outputs in the engine: one llguidance matcher per constrained sequence, advanced by each token it
samples, and the batch's allowed-token bitmasks computed together on the library's threads before sampling."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from frontend.engine.grammar import GrammarError, compile_structured

__all__ = ["TokenMasks"]


class TokenMasks:
    """Per engine: the library's view of the vocabulary (built on first use, once), matchers and mask buffers.

    A sequence under a constraint carries `grammar` (its matcher); before each sampling step `fill` sets its
    `token_mask` (int32 words, bit t of word t // 32 set when token t may follow), which both samplers apply."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(t for t in eos_ids if 0 <= t < vocab_size)
        self._lltok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._eos_words = self._buf = np.zeros(0, np.int32)
        self._worker: ThreadPoolExecutor | None = None
        self._started: tuple[Sequence, list, np.ndarray, Future] | None = None  # (seqs, rows, masks, the fill)
        self.filled_off_thread = 0  # steps whose masks `start` filled (a statistic)

    def _library_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            backend = getattr(self._tokenizer, "backend", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise GrammarError("structured outputs need the model's tokenizer (a `tokenizers` vocabulary)")
            if not self.eos_ids:
                raise GrammarError("structured outputs need an end-of-sequence token, and this model has none")
            # Logits rows may be longer than the vocabulary (padding): n_vocab covers them, never allowed. A
            # vocabulary longer than the rows keeps its size (the samplers ignore mask bits past a row's end).
            n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
            self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_ids)
            self._executor = llguidance.LLExecutor()
            words = (self._lltok.vocab_size + 31) // 32
            self._eos_words = np.zeros(words, np.uint32)
            for t in self.eos_ids:
                self._eos_words[t // 32] |= np.uint32(1 << (t % 32))
            self._eos_words = self._eos_words.view(np.int32)
            self._buf = np.zeros((0, words), np.int32)
        return self._lltok

    def matcher(self, structured) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint (raises GrammarError)."""
        m = llguidance.LLMatcher(self._library_tokenizer(), compile_structured(structured), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m

    def start(self, seqs: Sequence, counts: Sequence[int]) -> None:
        """Begins the masks of a step whose sampling waits for the next step() (its matchers hold every token up to
        it): the library fills them on its own threads, without the GIL, while the engine's thread reports the last
        step and schedules the next. `fill` with the same `seqs` list waits for them."""
        self._join()
        rows, masks = self._rows(seqs)
        if not rows:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="token-masks")
        job = self._worker.submit(fill_next_token_bitmask_par, self._executor,
                                  [(s.grammar, i) for i, s in enumerate(rows)], masks)
        self._started = (seqs, rows, masks, job)

    def fill(self, seqs: Sequence, counts: Sequence[int]) -> None:
        """Sets `token_mask` of every live constrained sequence of a sampling step (the others' stays None);
        `counts[i]`: the tokens seqs[i] generated before the one sampled now.

        Under min_tokens the end-of-sequence tokens stay banned, as for any sequence, unless the constraint is
        complete and nothing else may follow: then the grammar wins."""
        if self._started is not None and self._started[0] is seqs:
            _, rows, masks, job = self._started
            self._started = None
            job.result()
            self.filled_off_thread += 1
        else:
            self._join()
            rows, masks = self._rows(seqs)
            if rows:
                fill_next_token_bitmask_par(self._executor, [(s.grammar, i) for i, s in enumerate(rows)], masks)
        for s in seqs:
            if s.finished:  # ended by the read-back before this deferred sampling: its row is never used
                s.token_mask = None
        minimum = {id(s): n < s.params.min_tokens for s, n in zip(seqs, counts, strict=True)}
        for s, row in zip(rows, masks, strict=True):
            if s.finished:
                continue
            if minimum[id(s)] and not s.grammar.is_stopped():
                row &= ~self._eos_words
            s.token_mask = row

    def _rows(self, seqs: Sequence) -> tuple[list, np.ndarray]:
        """The live constrained sequences of a step and mask rows for them (the buffer grows as needed)."""
        rows = [s for s in seqs if s.grammar is not None and not s.finished]
        if rows and len(self._buf) < len(rows):
            self._buf = np.zeros((max(len(rows), 2 * len(self._buf)), self._buf.shape[1]), np.int32)
        return rows, self._buf[:len(rows)]

    def _join(self) -> None:
        """Waits for a started fill that nobody collected (its step was resolved another way): the buffer is reused."""
        if self._started is not None:
            job, self._started = self._started[3], None
            job.result()

    @staticmethod
    def advance(seq, token: int) -> tuple[bool, str | None]:
        """Feeds a sampled token to the sequence's matcher: (whether the constraint is now complete, an error)."""
        m = seq.grammar
        if not m.consume_token(token):
            return False, f"the structured output's grammar rejected token {token}: {m.get_error()}"
        return m.is_stopped(), None
