"""Long prompts through a real server process (the default SmolLM2 GGUF, whose context is 8,192 tokens), driven by
the official openai client: two at once, past every CUDA-graph partition cap on a GPU (tools/gpu_check.sh runs the
server tests with TEST_SERVER_BACKEND=cuda; the first decode past 2,048 tokens once aborted the server there), each
answered as the offline engine answers it, and the server healthy afterwards."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai

from tests.serving import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
BACKEND = os.environ.get("TEST_SERVER_BACKEND") or "auto"
# On a GPU: past every partition cap. On a CPU (MLX, whose prefill of thousands of tokens takes minutes on two
# cores): past the decode step's 1,024-token context bucket.
LENGTHS = (4000, 7000) if BACKEND == "cuda" else (1100, 1500)


def _offline(prompts: list[list[int]]) -> list[str]:
    from frontend.engine.llm import LLM
    from frontend.engine.sampling_params import SamplingParams

    llm = LLM(backend=BACKEND, dtype="f32" if BACKEND == "cuda" else None, max_num_seqs=4, progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_long_prompts_decode_through_the_server():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 40000, n).tolist() for n in LENGTHS]
    with ServerProcess("--max-num-seqs", "4") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)

        def ask(p):
            return client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(2) as pool:  # decoded together: a batch of two long contexts
            replies = list(pool.map(ask, prompts))
        for reply, n in zip(replies, LENGTHS, strict=True):
            assert reply.usage.prompt_tokens == n and reply.usage.completion_tokens == 8
        short = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
        assert short.choices[0].text and server.proc.poll() is None
        texts = [r.choices[0].text for r in replies]
    assert texts == _offline(prompts)
