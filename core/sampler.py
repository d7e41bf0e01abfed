"""Next-token sampling for a batch in which every request keeps its own parameters and random stream: the
specification every backend's sampler follows (backends.cuda.sampling does the same in torch).

Order (vLLM's): logit_bias, repetition penalty, frequency and presence penalties; then a structured output's token
mask (disallowed tokens to -inf); then greedy argmax, or temperature, top_k, top_p, min_p and one inverse-CDF draw.
Logprobs come from the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from core.sampling_params import SamplingParams

__all__ = ["TOP_P_SLACK", "SampleResult", "Sampler", "SamplerInput", "TokenHistory", "adjusted_logits",
           "adjusts_logits", "allowed_tokens", "make_generator", "needs_history", "output_counts", "sampling_probs",
           "seen_ids"]

_SMALL = 4096  # up to this many candidates one cumulative sum is cheapest; above, a two-level draw
_BLOCK = 256
TOP_P_SLACK = 1e-6  # weights are float32: a mass this close to top_p counts as reaching it (on every sampler)


@dataclass
class SampleResult:
    token: int
    logprob: float | None = None  # of the sampled token, under the raw logits
    top_logprobs: list[tuple[int, float]] | None = None  # (id, logprob), best first
    error: str | None = None  # this row could not be sampled: its request fails, the batch goes on


class SamplerInput(Protocol):
    params: SamplingParams
    generator: np.random.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # optional: `history`, a TokenHistory of these same tokens, which the penalties then read instead of the lists;
    # `token_mask`, int32 words of a structured output's allowed tokens (bit t % 32 of word t // 32), or None


class TokenHistory:
    """What the penalties read of a sequence, kept one token at a time: its distinct ids (prompt and output, in
    first-seen order) and how often each was generated. Rebuilding these from the token lists would cost O(length)
    a step for every penalized row; the penalties apply per distinct id, so the order does not matter."""

    def __init__(self, prompt: Sequence[int]):
        distinct = list(dict.fromkeys(int(t) for t in prompt))
        self._slot = {t: i for i, t in enumerate(distinct)}
        self._n = len(distinct)
        self._ids = np.zeros(max(16, 2 * self._n), np.int64)
        self._ids[:self._n] = distinct
        self._counts = np.zeros_like(self._ids)

    def add(self, token: int) -> None:
        """One generated token."""
        i = self._slot.get(token)
        if i is None:
            i = self._slot[token] = self._n
            if i == len(self._ids):
                self._ids, self._counts = (np.concatenate([a, np.zeros_like(a)]) for a in (self._ids, self._counts))
            self._ids[i] = token
            self._n += 1
        self._counts[i] += 1

    def seen(self) -> np.ndarray:
        """Every distinct id of the prompt and the output."""
        return self._ids[:self._n]

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct generated ids and how often each came."""
        counts = self._counts[:self._n]
        out = counts > 0
        return self._ids[:self._n][out], counts[out]


def make_generator(seed: int | None) -> np.random.Generator:
    """A request's own random stream: seeded, or from fresh OS entropy."""
    return np.random.Generator(np.random.PCG64(seed))


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether `adjusted_logits` changes anything for these parameters (logit_bias or a penalty)."""
    return bool(p.logit_bias) or p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def needs_history(p: SamplingParams) -> bool:
    """Whether sampling reads the sequence's tokens so far (the penalties)."""
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def _ids(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def adjusted_logits(row: np.ndarray, inp: SamplerInput) -> np.ndarray:
    """A float32 copy of `row` after logit_bias, then the repetition, frequency and presence penalties."""
    p, x = inp.params, np.array(row, dtype=np.float32)
    vocab = x.shape[0]
    if p.logit_bias:
        ids = _ids([int(t) for t in p.logit_bias])
        bias = np.array(list(p.logit_bias.values()), dtype=np.float32)
        ok = (ids >= 0) & (ids < vocab)  # out-of-vocabulary ids are the server's to reject
        x[ids[ok]] += bias[ok]
    if p.repetition_penalty != 1:
        seen = seen_ids(inp, vocab)
        v = x[seen]
        x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        out, counts = output_counts(inp, vocab)
        x[out] -= p.frequency_penalty * counts + p.presence_penalty
    return x


def allowed_tokens(words: np.ndarray, vocab: int) -> np.ndarray:
    """A token mask's words as one bool per token of a `vocab`-long row (ids past the words: not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little").view(bool)
    return bits[:vocab] if len(bits) >= vocab else np.concatenate([bits, np.zeros(vocab - len(bits), bool)])


def seen_ids(inp: SamplerInput, vocab: int) -> np.ndarray:
    """The distinct in-vocabulary ids of the prompt and the output: what the repetition penalty scales. From the
    input's TokenHistory when it has one (O(distinct ids)), else from the token lists."""
    history: TokenHistory | None = getattr(inp, "history", None)
    if history is not None:
        seen = history.seen()
        return seen[(seen >= 0) & (seen < vocab)]
    mask = np.zeros(vocab, dtype=bool)
    for ids in (_ids(inp.prompt_token_ids), _ids(inp.output_token_ids)):
        mask[ids[(ids >= 0) & (ids < vocab)]] = True  # out-of-vocabulary ids are the server's to reject
    return np.flatnonzero(mask)


def output_counts(inp: SamplerInput, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct in-vocabulary generated ids and how often each came: what the frequency and presence penalties
    subtract from. From the input's TokenHistory when it has one, else from the token list."""
    history: TokenHistory | None = getattr(inp, "history", None)
    out, counts = (history.output_counts() if history is not None else
                   np.unique(_ids(inp.output_token_ids), return_counts=True))
    ok = (out >= 0) & (out < vocab)
    return out[ok], counts[ok]


def _top_k_ids(x: np.ndarray, best: float, k: int) -> np.ndarray:
    """Ascending ids of the tokens at or above the k-th largest logit (ties at the edge all stay).

    Only tokens within a growing distance of the best are partitioned: far cheaper than the whole row."""
    delta = 1.0
    while delta < 1e4:
        ids = np.flatnonzero(x >= best - delta)
        if len(ids) >= k:
            break
        delta *= 4
    else:
        ids = np.arange(x.shape[0])
    if len(ids) > k:
        vals = x[ids]
        ids = ids[vals >= np.partition(vals, len(ids) - k)[len(ids) - k]]
    return ids


def _top_p(ids: np.ndarray | None, w: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest best-first set (ties broken by lower id) whose mass reaches top_p, as ascending ids."""
    total = float(w.sum(dtype=np.float64))
    target = top_p * total * (1 - TOP_P_SLACK)
    vals = w
    if len(w) > _SMALL:
        # The set is a best-first prefix, so any threshold whose survivors hold the target mass keeps
        # it whole; everything under `safe` together holds less than (1 - top_p) of the mass.
        safe = (1 - top_p) * total / len(w)
        for t in (1e-2, 1e-3, 1e-4, safe):
            t = max(t, safe)
            vals = w[w >= t]
            if t == safe or vals.sum(dtype=np.float64) >= target:
                break
    n, cut = _top_p_cut(vals, target)
    keep = np.flatnonzero(w > cut)
    if len(keep) < n:
        keep = np.sort(np.concatenate([keep, np.flatnonzero(w == cut)[: n - len(keep)]]))
    return (keep if ids is None else ids[keep]), w[keep]


def _top_p_cut(vals: np.ndarray, target: float) -> tuple[int, float]:
    """How many of the largest values it takes to reach `target`, and the smallest of them.

    A weighted quickselect halves a flat distribution's many values until few are left to sort."""
    done = 0
    while len(vals) > _SMALL:
        mid = len(vals) // 2
        part = np.partition(vals, mid)
        mass = part[mid:].sum(dtype=np.float64)
        if mass >= target:
            vals = part[mid:]
        else:
            done, target, vals = done + len(vals) - mid, target - mass, part[:mid]
    desc = np.sort(vals)[::-1]
    cum = np.cumsum(desc, dtype=np.float64)
    n = min(int(np.searchsorted(cum, target, side="left")) + 1, len(desc))
    return done + n, float(desc[n - 1])


def _candidates(x: np.ndarray, p: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """Ascending ids the row may draw (None: the whole vocabulary) and their weights, the best being 1."""
    best = x.max()
    ids = _top_k_ids(x, best, p.top_k) if 0 < p.top_k < x.shape[0] else None
    w = np.exp(((x if ids is None else x[ids]) - best) / p.temperature)
    if p.top_p < 1:
        ids, w = _top_p(ids, w, p.top_p)
    if p.min_p > 0:
        keep = w >= p.min_p
        ids = np.flatnonzero(keep) if ids is None else ids[keep]
        w = w[keep]
    return ids, w


def _pick(cdf: np.ndarray, target: float, w: np.ndarray) -> int:
    j = int(np.searchsorted(cdf, target, side="right"))
    # Rounding can put the target past the end: take the last token that has any weight.
    return j if j < len(cdf) else int(np.flatnonzero(w > 0)[-1])


def _draw(w: np.ndarray, u: float) -> int:
    """Inverse CDF in id order: position of the weight that u in [0, 1) falls on.

    Id order (not probability order) keeps the draw stable when near-equal logits swap places."""
    if len(w) <= _SMALL:
        cdf = np.cumsum(w, dtype=np.float64)
        return _pick(cdf, u * cdf[-1], w)
    sums = np.add.reduceat(w, np.arange(0, len(w), _BLOCK), dtype=np.float64)
    cdf = np.cumsum(sums)
    target = u * cdf[-1]
    b = _pick(cdf, target, sums)
    lo = b * _BLOCK
    block = w[lo:lo + _BLOCK]
    rest = target - (cdf[b - 1] if b else 0.0)
    return lo + _pick(np.cumsum(block, dtype=np.float64), rest, block)


def _sample_row(x: np.ndarray, p: SamplingParams, u: float) -> int:
    if not np.isfinite(x.max()):
        return int(x.argmax())  # all masked, or an infinite logit: nothing to weigh
    ids, w = _candidates(x, p)
    j = _draw(w, u)
    return j if ids is None else int(ids[j])


def sampling_probs(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled (temperature > 0) row of adjusted logits is drawn from; float64."""
    x = np.asarray(row, dtype=np.float32)
    ids, w = _candidates(x, params)
    probs = np.zeros(x.shape[0])
    probs[slice(None) if ids is None else ids] = w / w.sum(dtype=np.float64)
    return probs


def _logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    x = np.asarray(row, dtype=np.float32)
    best = x.max()
    lse = float(best) + float(np.log(np.exp(x - best).sum(dtype=np.float64)))
    top: list[tuple[int, float]] = []
    if k:
        ids = _top_k_ids(x, best, k)
        ids = ids[np.argsort(-x[ids], kind="stable")[:k]]
        top = [(int(i), float(x[i]) - lse) for i in ids]
    return float(x[token]) - lse, top


class Sampler:
    """Samples one token per row; row i of the logits belongs to inputs[i]. Never writes to the logits."""

    def __call__(self, logits: np.ndarray, inputs: Sequence[SamplerInput]) -> list[SampleResult]:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits of shape {logits.shape} for {len(inputs)} inputs")
        params = [s.params for s in inputs]
        masks = [getattr(s, "token_mask", None) for s in inputs]
        plain = [p.greedy and not adjusts_logits(p) and m is None for p, m in zip(params, masks, strict=True)]
        if all(plain) and all(p.logprobs is None for p in params):
            return [SampleResult(int(t)) for t in logits.argmax(axis=1)]
        rows = [i for i, ok in enumerate(plain) if ok]
        greedy = dict(zip(rows, logits[rows].argmax(axis=1).tolist(), strict=True)) if rows else {}
        results = []
        for i, (inp, p) in enumerate(zip(inputs, params, strict=True)):
            try:
                results.append(_sample_one(logits[i], inp, p, greedy.get(i), masks[i]))
            except Exception as e:  # noqa: BLE001 - one request's parameters must not fail every other row
                results.append(SampleResult(int(np.asarray(logits[i]).argmax()),
                                            error=f"sampling failed: {e.__class__.__name__}: {e}"))
        return results


def _sample_one(row: np.ndarray, inp: SamplerInput, p: SamplingParams, token: int | None,
                mask: np.ndarray | None) -> SampleResult:
    """One row; `token` is its argmax when the batch already took it (a plain greedy row)."""
    if token is None:
        x = adjusted_logits(row, inp) if adjusts_logits(p) or mask is not None else np.asarray(row, dtype=np.float32)
        if mask is not None:
            x[~allowed_tokens(mask, x.shape[0])] = -np.inf
        token = int(x.argmax()) if p.greedy else _sample_row(x, p, inp.generator.random())
    if p.logprobs is None:
        return SampleResult(token)
    return SampleResult(token, *_logprobs(row, token, p.logprobs))
