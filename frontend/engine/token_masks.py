"""Structured outputs in the engine: one llguidance matcher per constrained sequence, advanced by each token it
samples, and the batch's allowed-token bitmasks computed together on the library's threads before sampling."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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

    def fill(self, seqs: Sequence, counts: Sequence[int]) -> None:
        """Sets `token_mask` of every live constrained sequence of a sampling step (the others' stays None);
        `counts[i]`: the tokens seqs[i] generated before the one sampled now.

        Under min_tokens the end-of-sequence tokens stay banned, as for any sequence, unless the constraint is
        complete and nothing else may follow: then the grammar wins."""
        rows = [(s, n) for s, n in zip(seqs, counts, strict=True) if s.grammar is not None and not s.finished]
        for s in seqs:
            if s.finished:  # ended by the read-back before this deferred sampling: its row is never used
                s.token_mask = None
        if not rows:
            return
        if len(self._buf) < len(rows):
            self._buf = np.zeros((max(len(rows), 2 * len(self._buf)), self._buf.shape[1]), np.int32)
        masks = self._buf[:len(rows)]
        fill_next_token_bitmask_par(self._executor, [(s.grammar, i) for i, (s, _) in enumerate(rows)], masks)
        for i, (s, n) in enumerate(rows):
            row = masks[i]
            if n < s.params.min_tokens and not s.grammar.is_stopped():
                row &= ~self._eos_words
            s.token_mask = row

    @staticmethod
    def advance(seq, token: int) -> tuple[bool, str | None]:
        """Feeds a sampled token to the sequence's matcher: (whether the constraint is now complete, an error)."""
        m = seq.grammar
        if not m.consume_token(token):
            return False, f"the structured output's grammar rejected token {token}: {m.get_error()}"
        return m.is_stopped(), None
