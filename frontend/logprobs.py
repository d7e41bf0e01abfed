"""Token logprobs in OpenAI's two shapes: chat's `content` list and completions' parallel lists.

Each token's text is decoded in its context (the ids before it), so that the tokens join up to the generated text
(a SentencePiece token decoded alone loses its leading space) and `text_offset` follows the text; a token that ends
inside a UTF-8 character gets "" and the one that completes it gets the character. `bytes` are the token's own bytes
from the vocabulary, never the bytes of a decoded U+FFFD.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from frontend.engine.sequence import TokenLogprob
from ir.tokenizer import _bytes_to_unicode

__all__ = ["LogprobFormatter", "context_ids"]

_REPLACEMENT = "\ufffd"
_WINDOW = 8  # ids of context decoded before a token (enough for a leading space and a split character)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def context_ids(prompt: list[int], output: Sequence[int], start: int) -> list[int]:
    """The ids just before output[start]: the prompt's tail, then the output before it."""
    return (prompt[-_WINDOW:] + output[max(0, start - _WINDOW):start])[-_WINDOW:]


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()} if backend else {}

    # -- one token ----------------------------------------------------------------------------------
    def token_bytes(self, token: int) -> list[int]:
        """The bytes this token stands for in the vocabulary."""
        if self.tokenizer is None:
            return list(f"token_id:{token}".encode())
        if token in self._added:  # special and added tokens are spelled literally
            return list(self._added[token].encode())
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return []
        if self._byte_level and all(c in self._unbyte for c in piece):
            return [self._unbyte[c] for c in piece]
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return [int(m.group(1), 16)]
        return list(piece.replace("\u2581", " ").encode())

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _texts(self, tokens: list[int], context: list[int]) -> tuple[list[str], list[tuple[list[int], str]]]:
        """Each token's text in context, and the (ids, text) state before each (to decode alternatives in)."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in tokens], [([], "")] * len(tokens)
        ids = list(context)
        done = self._decode(ids)
        # Context ending inside a character: those ids wait for their end, only the text before them is done.
        for k in range(1, min(4, len(ids)) + 1):
            if not done.endswith(_REPLACEMENT):
                break
            done = self._decode(ids[:len(ids) - k])
        out, states = [], []
        for t in tokens:
            states.append((list(ids), done))
            ids.append(t)
            text = self._decode(ids)
            if text.endswith(_REPLACEMENT) or not text.startswith(done):
                out.append("")  # a character still incomplete: the token that completes it carries it
                continue
            out.append(text[len(done):])
            ids = ids[-_WINDOW:]
            done = self._decode(ids)
        return out, states

    def _alternative(self, state: tuple[list[int], str], token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        ids, done = state
        text = self._decode(ids + [token])
        return text[len(done):] if text.startswith(done) else self._decode([token])

    # -- the two shapes -----------------------------------------------------------------------------
    def chat(self, entries: list[TokenLogprob], top: int, context: list[int] = ()) -> dict[str, Any]:
        texts, states = self._texts([e.token for e in entries], list(context))

        def one(token: int, text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": _finite(logprob), "bytes": self.token_bytes(token)}

        return {"content": [one(e.token, text, e.logprob) | {
            "top_logprobs": [one(t, self._alternative(state, t), lp) for t, lp in (e.top or [])[:top]]}
            for e, text, state in zip(entries, texts, states, strict=True)]}

    def text(self, entries: list[TokenLogprob], offset: int, context: list[int] = ()) -> dict[str, Any]:
        tokens, states = self._texts([e.token for e in entries], list(context))
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self._alternative(state, t): _finite(lp) for t, lp in (e.top or [])}
                                 for e, state in zip(entries, states, strict=True)],
                "text_offset": offsets}


def _finite(x: float) -> float:
    # JSON has no -inf; a token the sampler could not pick (masked by top-k, bias) reports the lowest float
    return x if x > -3.0e38 else -9999.0
