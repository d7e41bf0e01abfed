"""POST /v1/embeddings: inputs -> token ids -> one engine request each (a prefill pooled into a vector) -> OpenAI's
body, each vector as floats or base64 (little-endian float32), truncated and renormalized for `dimensions`."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from core.sampling_params import SamplingParams
from frontend.errors import bad_request
from frontend.protocol import EmbeddingRequest
from frontend.responses import Reply
from frontend.serving import encode_texts, off_loop

if TYPE_CHECKING:
    from frontend.serving import OpenAIServing


def input_ids(serving: OpenAIServing, req: EmbeddingRequest) -> list[list[int]]:
    """The request's inputs as token ids, within the server's limits (a 400 naming the one passed)."""
    x = req.input
    texts = [x] if isinstance(x, str) else [t for t in x if isinstance(t, str)]
    count = 1 if isinstance(x, str) or isinstance(x[0], int) else len(x)
    serving.limits.check_inputs(count, texts)
    if texts:
        if serving.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", "input")
        return encode_texts(serving.tokenizer, texts)
    return [list(x)] if isinstance(x[0], int) else [list(t) for t in x]


def encode(vec: np.ndarray, dimensions: int | None, encoding_format: str) -> list[float] | str:
    """One vector as the response carries it; `dimensions`: its first ones, L2-normalized again (Matryoshka)."""
    if dimensions is not None:
        vec = vec[:dimensions]
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    vec = vec.astype("<f4")
    if encoding_format == "base64":
        return base64.b64encode(vec.tobytes()).decode("ascii")
    return vec.tolist()


async def embeddings(serving: OpenAIServing, req: EmbeddingRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    pooling = serving.model.pooling
    if pooling is None:
        raise bad_request(f"{serving.model.id} generates text and has no embeddings: /v1/embeddings needs an "
                          "embedding model (one with sentence-transformers pooling files, or served with --task "
                          "embed)", "model")
    if req.dimensions is not None:
        try:
            pooling.check_dimensions(req.dimensions)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
    prompts = await off_loop(input_ids, serving, req)
    for p in prompts:
        try:
            serving.engine.check(p, None)
        except ValueError as e:
            raise bad_request(str(e), "input") from None
    serving.limits.check_waiting(serving.engine.num_waiting(), serving.engine.num_waiting_seqs(), len(prompts),
                                 len(prompts), serving.max_waiting)
    # The completions' machinery runs the requests (metrics, aborts when the client leaves); the Reply only counts.
    reply = Reply("embedding", serving.model.id, prompt_tokens=sum(len(p) for p in prompts))
    outs = await serving._collect(prompts, SamplingParams(), reply)  # one sequence each
    data = [{"object": "embedding", "index": i, "embedding": encode(out.embedding, req.dimensions,
                                                                    req.encoding_format)}
            for i, out in enumerate(outs)]
    return {"object": "list", "data": data, "model": serving.model.id,
            "usage": {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}}
