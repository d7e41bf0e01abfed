"""Long prompts through a real server process (the default SmolLM2 GGUF, whose context is 8,192 tokens), driven by
the official openai client: two at once, past every CUDA-graph partition cap on a GPU (tools/gpu_check.sh runs the
server tests with TEST_SERVER_BACKEND=cuda; the first decode past 2,048 tokens once aborted the server there), each
answered as the offline engine answers it, and the server healthy afterwards."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from tests.serving import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
BACKEND = os.environ.get("TEST_SERVER_BACKEND") or "auto"
# On a GPU: past every partition cap. On a CPU (MLX, whose prefill of thousands of tokens takes minutes on two
# cores): past the decode step's 1,024-token context bucket.
LENGTHS = (4000, 7000) if BACKEND == "cuda" else (1040, 1100)


NEAR_TIE = 1e-3  # nats: where the offline engine's top two tokens are this close, fp32 rounding may pick either


def _agree(texts: list[str], prompts: list[list[int]], model: str | None = None) -> None:
    """The server's greedy answers are the offline engine's, or part from them only at a near tie of the offline
    engine's own top two tokens: on a GPU even fp32 sums depend on the batch (cuBLAS picks kernels by shape, the
    decode's split-K grid by batch size), and the two paths batch the prompts differently."""
    from core.sampling_params import SamplingParams
    from frontend.engine.llm import LLM

    llm = LLM(model=model, backend=BACKEND, dtype="f32" if BACKEND == "cuda" else None, max_num_seqs=4,
              progress=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    for text, out in zip(texts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        got = out.outputs[0]
        if text == got.text:
            continue
        j = next(j for j in range(len(got.token_ids))
                 if not text.startswith(llm.tokenizer.decode(got.token_ids[:j + 1])))
        top = sorted((lp for _, lp in got.logprobs[j].top), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, (f"server {text!r} vs offline {got.text!r}: they part at token {j}, "
                                            f"where the offline top two differ by {top[0] - top[1]:.3g} nats")


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
    _agree(texts, prompts)


@pytest.mark.skipif(BACKEND != "cuda", reason="a 30,000-token prefill takes too long on a CPU")
def test_a_30000_token_prompt_through_the_server(tmp_path):
    """Past SmolLM2's 8,192 tokens: a tiny random llama with SmolLM2's tokenizer and a 32,768-token context, a
    30,000- and a 4,000-token prompt decoded together with CUDA graphs, as the offline engine answers them."""
    from ir.default_model import default_model_path
    from tests.tiny_chat_model import save_tiny_chat_model

    folder = save_tiny_chat_model(tmp_path / "tiny32k", default_model_path(), max_len=32768)
    rng = np.random.default_rng(4)
    lengths = (30000, 4000)
    prompts = [rng.integers(100, 40000, n).tolist() for n in lengths]
    with ServerProcess("--w", str(folder), "--max-num-seqs", "4") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        served = client.models.list().data[0].id
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda p: client.completions.create(
                model=served, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}), prompts))
        assert [r.usage.prompt_tokens for r in replies] == list(lengths)
        assert server.proc.poll() is None
        texts = [r.choices[0].text for r in replies]
    _agree(texts, prompts, str(folder))
