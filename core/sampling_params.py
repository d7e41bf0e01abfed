"""Per-request sampling and stopping parameters, with the checks the server reports as HTTP 400."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are served as greedy (vLLM's _SAMPLING_EPS): in float32 a temperature of 1e-300 is 0,
# and dividing the logits by it gives 0/0.
GREEDY_BELOW = 1e-5
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """What a request's output must match, enforced by a token mask at every step. `spec` is text, so that it
    travels to the engine process as it is: the schema's JSON ("json_schema"; None for any JSON object), the
    regex, a JSON list of the choices, or the grammar's text (Lark or GBNF)."""

    kind: str
    spec: str | None = None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # response_format, structured_outputs, tool_choice "required"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1, 0 (off) or a positive integer"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (self.structured is None or self.structured.kind in STRUCTURED_KINDS, "structured",
             f"must be one of {', '.join(STRUCTURED_KINDS)}"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise SamplingParamsError(name, f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class SamplingParamsError(ValueError):
    """A parameter out of range; `param` names it for the OpenAI error body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
