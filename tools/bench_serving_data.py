"""The prompts tools/bench_serving sends: random ones of given lengths (token ids, or text for servers that take
only text), or the first human turn of ShareGPT-format conversations (as vLLM's `bench serve` reads them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["BenchPrompt", "load_tokenizer", "random_prompts", "sharegpt_prompts"]

_MIN_LEN = 4  # ShareGPT turns shorter than this many tokens say too little to time (vLLM drops them too)


@dataclass
class BenchPrompt:
    prompt: str | list[int]  # what the request sends as `prompt` (or as the user's message, for chat)
    input_len: int  # its length in tokens by our tokenizer (the server's usage, when it reports one, wins)
    output_len: int  # max_tokens


def load_tokenizer(path: str | Path | None):
    """A tokenizer from a GGUF file, an HF folder or a tokenizer.json (default: the default model's)."""
    from ir.tokenizer import Tokenizer

    if path is None:
        from ir.default_model import default_model_path

        path = default_model_path()
    path = Path(path)
    if path.suffix == ".gguf":
        from ir.formats.gguf_file import GGUFFile

        return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    return Tokenizer.from_dir(path.parent if path.name == "tokenizer.json" else path)


def _plain_ids(tokenizer) -> np.ndarray:
    """The ids random prompts draw from: the whole vocabulary but its special (added) tokens."""
    backend = getattr(tokenizer, "backend", None)
    special = set(backend.get_added_tokens_decoder()) if backend is not None else set()
    special |= {i for i in (getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)) if i is not None}
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], np.int64)


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, n)


def random_prompts(tokenizer, n: int, input_len: int, output_len: int, seed: int, as_text: bool = False,
                   range_ratio: float = 0.0) -> list[BenchPrompt]:
    """n prompts of random tokens; lengths uniform within +-range_ratio of the given ones.

    As text, the random ids are decoded and the text re-encoded and cut to length, so that the server's own
    tokenization of it comes out close to input_len."""
    rng = np.random.default_rng(seed)
    pool = _plain_ids(tokenizer)
    ins, outs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    prompts = []
    for k, m in zip(ins.tolist(), outs.tolist(), strict=True):
        ids = rng.choice(pool, k).tolist()
        if as_text:
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:k]
            text = tokenizer.decode(ids)
            prompts.append(BenchPrompt(text, len(tokenizer.encode(text, add_special_tokens=False)), m))
        else:
            prompts.append(BenchPrompt(ids, k, m))
    return prompts


def _first_exchange(entry: dict) -> tuple[str, str] | None:
    """The first human turn and the answer after it."""
    turns = entry.get("conversations") or entry.get("conversation") or []
    for i, turn in enumerate(turns[:-1]):
        if turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
            answer = turns[i + 1].get("value")
            return (turn["value"], answer) if isinstance(answer, str) else None
    return None


def sharegpt_prompts(path: str | Path, tokenizer, n: int, seed: int, max_input_len: int, max_output_len: int,
                     output_len: int | None = None) -> list[BenchPrompt]:
    """n conversations, shuffled by seed: the first human turn as the prompt, max_tokens the reference answer's
    length (or output_len) capped at max_output_len; prompts longer than max_input_len tokens are skipped."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    order = np.random.default_rng(seed).permutation(len(data))
    prompts: list[BenchPrompt] = []
    for i in order.tolist():
        pair = _first_exchange(data[i]) if isinstance(data[i], dict) else None
        if pair is None:
            continue
        k = len(tokenizer.encode(pair[0], add_special_tokens=False))
        m = output_len or len(tokenizer.encode(pair[1], add_special_tokens=False))
        if k < _MIN_LEN or m < _MIN_LEN or k > max_input_len:
            continue
        prompts.append(BenchPrompt(pair[0], k, min(m, max_output_len)))
        if len(prompts) == n:
            return prompts
    raise ValueError(f"{path}: only {len(prompts)} usable conversations (first turn {_MIN_LEN}-{max_input_len} "
                     f"tokens, an answer of {_MIN_LEN} or more), {n} asked for")
