"""When a sequence stops (a stop or end-of-sequence token, a stop string, max_tokens or the model's context), and
what the sampler reads of a sequence whose min_tokens still bans those tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.sampler import TokenHistory
from core.sampling_params import SamplingParams
from frontend.engine.sequence import Sequence

__all__ = ["MinTokensView", "StopRules"]


@dataclass(slots=True)
class MinTokensView:
    """What the sampler reads of a sequence under min_tokens: its stop tokens banned through logit_bias."""

    seq: Sequence
    params: SamplingParams

    @property
    def generator(self):
        return self.seq.generator

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids

    @property
    def history(self) -> TokenHistory | None:
        return self.seq.history


@dataclass(frozen=True, slots=True)
class StopRules:
    """The engine's stop rules: the model's end-of-sequence ids and its context length."""

    eos_ids: frozenset[int]
    max_model_len: int

    def is_stop_token(self, seq: Sequence, token: int, n_out: int) -> bool:
        """Whether `token`, the n_out-th generated, stops the sequence (never before min_tokens); records a stop id."""
        p = seq.params
        if n_out < p.min_tokens:
            return False
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return True
        return not p.ignore_eos and token in self.eos_ids

    def reason(self, seq: Sequence, stop_token: bool, n_out: int) -> str | None:
        """"stop", "length" or None (runs on); a stop string is recorded as the stop reason."""
        if stop_token:
            return "stop"
        if seq.detokenizer.stopped:
            seq.stop_reason = seq.detokenizer.stop_string
            return "stop"
        return "length" if self.length_reached(seq, n_out) else None

    def length_reached(self, seq: Sequence, n_out: int) -> bool:
        """Whether `n_out` generated tokens end the sequence by max_tokens or the model's context."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and n_out >= max_tokens) or seq.num_prompt_tokens + n_out >= self.max_model_len

    def min_tokens_view(self, seq: Sequence) -> MinTokensView:
        """The sequence as the sampler sees it under min_tokens: its stop tokens banned by a bias of -inf, applied by
        either sampler after the logprobs are taken from the raw logits (logprobs report the model's own)."""
        if seq.min_tokens_params is None:
            p = seq.params
            stops = (set() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids)
            seq.min_tokens_params = replace(p, logit_bias={**(p.logit_bias or {}), **dict.fromkeys(stops, -np.inf)})
        return MinTokensView(seq, seq.min_tokens_params)
