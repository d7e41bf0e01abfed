"""Logprob tokens decoded in context: they join up to the text, offsets follow it, and `bytes` are each token's own
(a token that ends inside a UTF-8 character reports its real bytes, not U+FFFD's)."""

from __future__ import annotations

import numpy as np

from frontend.engine.sequence import TokenLogprob
from frontend.logprobs import LogprobFormatter, context_ids

TEXT = " Le café coûte 3€, très cher 😀 — 北京 ok"


def entries(ids: list[int]) -> list[TokenLogprob]:
    rng = np.random.default_rng(0)
    return [TokenLogprob(t, float(-rng.random()), [(t, -0.1), (int(rng.integers(0, 1000)), -2.0)]) for t in ids]


def test_tokens_join_up_and_bytes_are_the_tokens_own(smollm):
    tok = smollm.tokenizer
    prompt = tok.encode("Say something:")
    ids = tok.encode(TEXT, add_special_tokens=False)
    fmt = LogprobFormatter(tok)
    split = [t for t in ids if tok.decode([t]).endswith("\ufffd")]
    assert split, "the text should have characters split over byte tokens"
    lp = fmt.text(entries(ids), 7, context_ids(prompt, [], 0))
    text = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(lp["tokens"]) == text == TEXT
    assert lp["text_offset"] == [7 + len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    chat = fmt.chat(entries(ids), 2, context_ids(prompt, [], 0))["content"]
    assert bytes(b for e in chat for b in e["bytes"]) == TEXT.encode()
    assert [e["token"] for e in chat] == lp["tokens"]
    for e, t in zip(chat, ids, strict=True):
        assert e["top_logprobs"][0]["bytes"] == e["bytes"] == fmt.token_bytes(t)
        assert "\ufffd" not in bytes(e["bytes"]).decode("utf-8", "replace") or t in split


def test_streamed_pieces_join_up_too(smollm):
    """The streaming path formats a few new tokens at a time, with the earlier output as context."""
    tok = smollm.tokenizer
    prompt = tok.encode("Say something:")
    ids = tok.encode(TEXT, add_special_tokens=False)
    fmt = LogprobFormatter(tok)
    pieces, start = [], 0
    for size in [1, 2, 1, 3, 1, 1, 2] * 10:
        if start >= len(ids):
            break
        new = ids[start:start + size]
        pieces += fmt.text(entries(new), 0, context_ids(prompt, ids, start))["tokens"]
        start += len(new)
    assert "".join(pieces) == TEXT
