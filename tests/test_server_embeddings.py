"""POST /v1/embeddings through a real server and the official openai client: a tiny Qwen3 embedding model (SmolLM2's
tokenizer, Matryoshka) in the engine process, and a plain tiny Qwen3 causal LM served with vLLM's --runner pooling in
the server's own process; vectors against transformers' Qwen3Model, base64, dimensions, usage and the 400s (a
generation model's: tests/test_server.py)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from tiny_embed import hf_embedding, save_tiny_embedding_qwen3

from tests.serving import ServerProcess
from tools.tiny_hf import random_causal_lm, random_prompt

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors", "x"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, smollm_path):
    """(server, client, transformers' decoder, the tokenizer's encode, the served model's id)."""
    folder = tmp_path_factory.mktemp("embedder")
    decoder = save_tiny_embedding_qwen3(folder, "last", config={"is_matryoshka": True}, tokenizer_path=smollm_path)
    from ir.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    with ServerProcess("--w", str(folder), "--mem", "16", "--max-prompts", "4") as s:
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        yield s, client, decoder, lambda t: tok.backend.encode(t).ids, client.models.list().data[0].id


def _vectors(r) -> list[np.ndarray]:
    assert [d.index for d in r.data] == list(range(len(r.data))) and all(d.object == "embedding" for d in r.data)
    return [np.asarray(d.embedding, np.float32) for d in r.data]


def test_strings_and_token_ids_equal_transformers(embedder):
    server, client, decoder, encode, model = embedder
    one = client.embeddings.create(model=model, input=TEXTS[0])
    [v] = _vectors(one)
    np.testing.assert_allclose(v, hf_embedding(decoder, encode(TEXTS[0])), atol=1e-4, rtol=0)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(encode(TEXTS[0]))
    many = _vectors(client.embeddings.create(model=one.model, input=TEXTS))
    for text, vec in zip(TEXTS, many, strict=True):
        np.testing.assert_allclose(vec, hf_embedding(decoder, encode(text)), atol=1e-4, rtol=0)
    ids = [encode(t) for t in TEXTS[:2]]
    by_ids = _vectors(client.embeddings.create(model=one.model, input=ids))
    np.testing.assert_allclose(by_ids[1], many[1], atol=1e-6, rtol=0)
    [single] = _vectors(client.embeddings.create(model=one.model, input=ids[0]))
    np.testing.assert_allclose(single, many[0], atol=1e-6, rtol=0)


def test_base64_and_dimensions(embedder):
    server, client, decoder, encode, model = embedder
    floats = _vectors(client.embeddings.create(model=model, input=TEXTS[:2], encoding_format="float"))
    # the client asks for base64 itself when no format is given (and decodes it); given, it hands the text over
    r = client.embeddings.create(model=model, input=TEXTS[:2], encoding_format="base64")
    for d, vec in zip(r.data, floats, strict=True):
        assert isinstance(d.embedding, str)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(d.embedding), "<f4"), vec)
    [short] = _vectors(client.embeddings.create(model=model, input=TEXTS[0], dimensions=16))
    ref = hf_embedding(decoder, encode(TEXTS[0]))[:16]
    np.testing.assert_allclose(short, ref / np.linalg.norm(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(input=TEXTS[0], dimensions=65), "dimensions", "between 1 and 64"),
    (dict(input=["a"] * 5), "input", "at most 4 inputs"),
    (dict(input=[1] * 300), "input", "maximum context length is 256"),
    (dict(input=[10**6]), "input", "out of range for a vocabulary"),
    (dict(input=""), "input", ""),
    (dict(input=[]), "input", ""),
    (dict(input=TEXTS[0], encoding_format="hex"), "encoding_format", ""),
])
def test_bad_embedding_requests_get_400(embedder, kwargs, param, words):
    client, model = embedder[1], embedder[4]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, **kwargs)
    assert e.value.body["param"].startswith(param) and words in e.value.body["message"]


def test_an_embedding_model_refuses_chat_and_completions(embedder):
    client, model = embedder[1], embedder[4]
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=model, prompt="hi")


def test_runner_pooling_in_process(tmp_path, smollm_path):
    """A causal LM's folder (model.-named tensors, an lm_head, no pooling files) served for embeddings by vLLM's
    flag: its last token, normalized (Qwen3-Embedding's default), from the engine in the server's thread."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    lm = random_causal_lm(cfg, seed=3)
    lm.save_pretrained(tmp_path)
    ids = [random_prompt(7, 9, 512), random_prompt(8, 30, 512)]
    with ServerProcess("--w", str(tmp_path), "--mem", "16", "--runner", "pooling", "--engine-in-process") as s:
        client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        vecs = _vectors(client.embeddings.create(model=tmp_path.name, input=ids))
        with pytest.raises(openai.BadRequestError, match="not a Matryoshka model"):
            client.embeddings.create(model=tmp_path.name, input=ids, dimensions=8)
    for p, v in zip(ids, vecs, strict=True):
        np.testing.assert_allclose(v, hf_embedding(lm.model, p), atol=1e-4, rtol=0)
