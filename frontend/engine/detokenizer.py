"""Incremental detokenization with stop strings, as vLLM does it.

Each step decodes only a small window of ids (prefix/read offsets) and emits text once it no longer
ends in U+FFFD, so a character split over byte tokens comes out whole. Text that may still become a
stop string is held back until the next tokens settle it; a matched stop string ends the output.
The emitted text is kept as a list of pieces (joined only when read): `text += piece` would copy the whole text
at every token.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.sampling_params import SamplingParams
from ir.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_CONTEXT = 5  # prompt ids decoded before the first output id (vLLM's initial offset)
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas; `text` is everything emitted so far, `pieces` the
    deltas that make it up (only ever appended to) and `text_len` its length."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer, self.params = tokenizer, params
        self.pieces: list[str] = []
        self.text_len = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched
        self.num_tokens = 0
        # The prompt's tail gives the first output ids their context (a leading space, a merged byte).
        self._ids = [int(i) for i in prompt_token_ids[-_CONTEXT:]]
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT):  # the prompt ends mid-character: no context
            self._ids, self._prefix_text = [], ""
        self._read = len(self._ids)  # ids before it are context, already turned into text
        self._held = ""  # decoded, not emitted: it may be the start of a stop string
        self._longest_stop = max(map(len, params.stop), default=0)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it makes emittable (often "", never after a stop)."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        # Nothing new (a skipped special token) or a character still incomplete: wait for more ids.
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new = text[len(self._prefix_text):]
        self._advance()
        return self._release(new, final=False)

    def flush(self) -> str:
        """Release everything held back, when the sequence ends for another reason than a stop string.

        If that text completes a stop string, it is cut there and `stopped` is set as in `add`."""
        if self.stopped:
            return ""
        new = self._decode(self._ids)[len(self._prefix_text):]  # may end in U+FFFD: so does a full decode
        self._advance()
        return self._release(new, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _advance(self) -> None:
        # The ids just decoded become the next ids' context; older ones are dropped: cost stays O(window).
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def _release(self, new: str, final: bool) -> str:
        if not self.params.stop:
            return self._emit(new)
        buf = self._held + new
        if new and self.num_tokens > self.params.min_tokens:
            hit = self._find_stop(buf, len(self._held))
            if hit is not None:
                stop, start = hit
                out = buf[:start + len(stop) if self.params.include_stop_str_in_output else start]
                self.stopped, self.stop_string, self._held = True, stop, ""
                return self._emit(out)
        keep = 0 if final else self._stop_prefix_len(buf)
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        return self._emit(out)

    def _emit(self, out: str) -> str:
        if out:
            self.pieces.append(out)
            self.text_len += len(out)
        return out

    def _find_stop(self, buf: str, old: int) -> tuple[str, int] | None:
        """The stop string that completes first in `buf` (the earlier start on a tie) and where it starts.

        Earlier text was searched before, so only matches that end in the new part count."""
        best: tuple[int, int, str] | None = None
        for stop in self.params.stop:
            at = buf.find(stop, max(0, old - len(stop) + 1))
            if at != -1 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[2], best[1])

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest end of `buf` that a stop string starts with (but does not equal)."""
        for k in range(min(len(buf), self._longest_stop - 1), 0, -1):
            tail = buf[-k:]
            if any(len(stop) > k and stop.startswith(tail) for stop in self.params.stop):
                return k
        return 0


class NoText:
    """Stands in for the detokenizer of a model without a tokenizer (token ids only)."""

    stopped, stop_string, text, text_len = False, None, "", 0
    pieces: tuple[str, ...] = ()

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
