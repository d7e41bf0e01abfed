"""The OpenAI request schemas (pydantic, strict types) and their mapping onto SamplingParams.

Strict: a string where a number belongs is a 400, as with OpenAI, not a silent conversion. Unknown
fields are ignored (clients send `store`, `metadata`, ...), and logged once per request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.sampling_params import SamplingParams

_STRICT = ConfigDict(strict=True, extra="ignore")
TokenIds = list[Annotated[int, Field(ge=0)]]


class _Model(BaseModel):
    model_config = _STRICT


class StreamOptions(_Model):
    include_usage: bool = False


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str = Field(description="the arguments as a JSON string, as the API returned them")


class ToolCall(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls (its content may be null)")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description="letters, digits, _ . : -; at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of type object")
    strict: bool | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class SamplingFields(_Model):
    """The fields chat and completion requests share."""

    model: str | None = Field(None, description="the served model's id (default: that model)")
    max_tokens: int | None = Field(None, ge=1, description="default: the server's --max-gen-tokens, "
                                   "or what the context leaves")
    temperature: float | None = Field(None, ge=0, description="0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, description="at most the server's --max-n (default 128)")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, description="vLLM's: not supported (a 400), rather than ignored")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured outputs (frontend/structured_request.py): at most one of these a request
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"name", "schema", "strict"}}')
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: one of json (a schema), regex, choice, grammar (Lark or GBNF), json_object")
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="takes precedence over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="the reply continues the last message (a prefilled "
                                         "assistant turn); implies add_generation_prompt false")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    tools: list[ToolDef] | None = Field(None, description="functions the model may call (reach the template)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required and a named function constrain the output's JSON")
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="handed to the chat template; none also sets enable_thinking false")


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] | \
        Annotated[TokenIds, Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, description="must equal n when given")
    suffix: str | None = Field(None, description="not supported")


class EmbeddingRequest(_Model):
    """OpenAI's /v1/embeddings request."""

    model: str | None = Field(None, description="the served model's id (default: that model)")
    input: Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] | \
        Annotated[TokenIds, Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32")
    dimensions: int | None = Field(None, ge=1, description="Matryoshka models only: truncated, then renormalized")
    user: str | None = None


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: TokenIds


class ServerDefaults(_Model):
    """Server-wide sampling defaults (the CLI's --temperature etc.); a request's own value wins."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_gen_tokens: int | None = None


def sampling_params(req: SamplingFields, defaults: ServerDefaults, max_tokens: int, logprobs: int | None) -> \
        SamplingParams:
    """The engine's parameters for a validated request; max_tokens is already resolved by the caller."""
    def pick(name: str):
        value = getattr(req, name)
        return getattr(defaults, name) if value is None else value

    return SamplingParams(
        n=req.n, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
        presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
        repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        seed=None if req.seed is None else req.seed % 2**63, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)
