"""What one request may ask of an engine: numbers fixed at start-up, so the API process checks them without a
round trip to the engine process."""

from __future__ import annotations

from dataclasses import dataclass

from core.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestBounds:
    vocab_size: int
    max_model_len: int
    kv_tokens: int  # what the KV cache holds: one sequence can never grow past it

    def check(self, prompt: list[int], params: SamplingParams | None) -> None:
        """Raises ValueError for a request the engine would refuse (context, KV capacity, token ids). `params` None:
        an embedding request, which generates nothing."""
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}")
        if params is None:
            if len(prompt) > min(self.max_model_len, self.kv_tokens):
                raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens (the KV cache "
                                 f"holds {self.kv_tokens}); the input has {len(prompt)}")
            return
        want = len(prompt) + (params.max_tokens or 1)
        if want > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"has {len(prompt)} tokens and max_tokens asks for {params.max_tokens or 1} more")
        if want > self.kv_tokens:
            raise ValueError(f"the KV cache holds {self.kv_tokens} tokens, fewer than the {want} this request may "
                             "need")
