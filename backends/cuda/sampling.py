"""The engine's sampler as batched torch ops on the logits' device, token for token the same.

core.sampler is the specification: same order of adjustments, same float32/float64 steps,
and each non-greedy row takes one `generator.random()`, in row order, so a seeded request draws the
same tokens on either sampler. Host inputs reach the device in one copy; results come back in one, which the
engine reads only after launching the next step (`launch` returns before the device is done).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from core.sampler import TOP_P_SLACK, SampleResult, SamplerInput, adjusts_logits, output_counts, seen_ids

__all__ = ["TorchSampler"]

# Host arrays by the dtype they take on the device; each group is converted in one op.
_LONG = ("b_row", "b_id", "r_row", "r_id", "f_row", "f_id", "s_row", "top_k", "p_row", "l_row", "m_row")
_FLOAT = ("b_val", "rep", "temp", "min_p")  # float32: numpy applies these in float32
_DOUBLE = ("fp", "pp", "f_cnt", "u", "top_p")
_BLOCK = 256  # torch scans a row with one thread block; blocks of this size scan in parallel
# torch's arg-reductions give a row one thread block too: a greedy step's argmax over a 128,256-wide vocabulary took
# 27.6 us on an H200 at batch 1 and 26.8 at 16, every decode step (session 19's kernel profile, PDL off). Split in
# this many parts, the first pass reduces PARTS rows a row in parallel and the second only PARTS values. Not yet
# timed (GPU_QUEUE); LLM_ENGINE_ARGMAX_PARTS=1 keeps torch's one pass.
_ARGMAX_PARTS = int(os.environ.get("LLM_ENGINE_ARGMAX_PARTS", "32") or 32)
_ARGMAX_MIN_PART = 512  # a narrower row takes torch's one pass


def argmax_rows(x: torch.Tensor, parts: int = _ARGMAX_PARTS) -> torch.Tensor:
    """x.argmax(1), the first of equal maxima (and of NaNs, which count as the largest, as torch's): on a GPU, the
    row's `parts` equal parts each reduced to its first maximum and where it lies, then the first part holding the
    row's. CPU tensors, and a row not split evenly or under parts * _ARGMAX_MIN_PART wide, take torch's one pass."""
    return _argmax_parts(x, parts) if x.device.type == "cuda" else x.argmax(1)


def _argmax_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """argmax_rows's two passes, on any device."""
    n, vocab = x.shape
    if parts <= 1 or vocab % parts or vocab < parts * _ARGMAX_MIN_PART:
        return x.argmax(1)
    part = vocab // parts
    best, at = x.reshape(n, parts, part).max(2)
    which = best.argmax(1, keepdim=True)
    return (at.gather(1, which) + which * part).squeeze(1)


def _rows_and(rows: list[int], per_row: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row, value) pairs: each of `rows` repeated once for each of its values."""
    if not rows:
        return np.zeros(0), np.zeros(0)
    return np.repeat(np.asarray(rows, np.int64), [len(v) for v in per_row]), np.concatenate(per_row)


def _host_arrays(inputs: Sequence[SamplerInput], vocab: int) -> dict[str, np.ndarray]:
    """Everything the device needs from the requests, as flat arrays."""
    params = [s.params for s in inputs]
    h: dict[str, np.ndarray | list] = {}
    # Later duplicates win, as with numpy's `x[ids] += bias`.
    bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias
            for t, b in {int(t): float(b) for t, b in p.logit_bias.items()}.items() if 0 <= t < vocab]
    h["b_row"], h["b_id"], h["b_val"] = zip(*bias, strict=True) if bias else ([], [], [])
    # The penalties' ids come distinct (with counts) from each sequence's TokenHistory: O(distinct ids) a step,
    # not O(length), and no counting on the device.
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    h["r_row"], h["r_id"] = _rows_and(rep, [seen_ids(inputs[i], vocab) for i in rep])
    h["rep"] = [p.repetition_penalty for p in params]
    freq = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    counted = [output_counts(inputs[i], vocab) for i in freq]
    h["f_row"], h["f_id"] = _rows_and(freq, [ids for ids, _ in counted])
    h["f_cnt"] = np.concatenate([c for _, c in counted]) if counted else []
    h["fp"] = [p.frequency_penalty for p in params]
    h["pp"] = [p.presence_penalty for p in params]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    h["s_row"] = sampled
    h["u"] = [inputs[i].generator.random() for i in sampled]  # row order, as the CPU sampler draws
    h["temp"] = [params[i].temperature for i in sampled]
    h["top_k"] = [params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in sampled]
    h["top_p"] = [params[i].top_p for i in sampled]
    h["min_p"] = [params[i].min_p for i in sampled]
    h["p_row"] = [j for j, i in enumerate(sampled) if params[i].top_p < 1]  # among the sampled rows
    h["l_row"] = [i for i, p in enumerate(params) if p.logprobs is not None]
    h["m_row"] = [i for i, s in enumerate(inputs) if getattr(s, "token_mask", None) is not None]
    return {k: np.asarray(h[k], dtype=np.float64) for k in _LONG + _FLOAT + _DOUBLE}


class _MaskStage:
    """Pinned host slots for the masked rows' words, two in turn: a step's words are copied into one and sent to the
    device from there, while the other's copy (the step before) may still be queued. No pinning a step."""

    def __init__(self):
        self.slots: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def to_device(self, inputs: Sequence[SamplerInput], rows: list[int], device: torch.device) -> torch.Tensor:
        """The masked rows' token-mask words [rows, words] as int32 on the device, in one copy."""
        n, words = len(rows), len(inputs[rows[0]].token_mask)
        if device.type != "cuda":
            return torch.from_numpy(np.stack([inputs[i].token_mask for i in rows])).to(device)
        i = self.turn = 1 - self.turn
        if len(self.slots) < 2 or self.slots[i].shape[0] < n or self.slots[i].shape[1] != words:
            shape = (max(n, self.slots[i].shape[0] if self.slots else 0), words)
            self.slots = [torch.empty(shape, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self.events = [None, None]
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copy out of this slot two steps ago (long done in practice)
        slot = self.slots[i][:n]
        np.stack([inputs[r].token_mask for r in rows], out=slot.numpy())
        out = slot.to(device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return out


@functools.cache
def _bit_lookup(vocab: int, n_words: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token id its mask word and that word's bit (0 for ids past the words: never allowed), made once per
    vocabulary: a step's masking is then a gather, an and and a fill (it runs eagerly, outside the step's graph)."""
    ids = torch.arange(vocab, device=device)
    bit = torch.where(ids < 32 * n_words, torch.ones_like(ids, dtype=torch.int32) << (ids & 31).int(), 0)
    return (ids >> 5).clamp(max=n_words - 1), bit


def _apply_masks(x: torch.Tensor, rows: torch.Tensor | list[int], words: torch.Tensor) -> torch.Tensor:
    """x with each masked row's disallowed tokens at -inf (a token past the mask's words is disallowed); `rows` (in
    order) index x's masked rows."""
    word, bit = _bit_lookup(x.shape[1], words.shape[1], x.device)
    banned = (words[:, word] & bit) == 0
    if len(rows) == len(x):  # every row constrained (rows are in order): fill in place, no gather and scatter
        return x.masked_fill_(banned, float("-inf"))
    rows = torch.as_tensor(rows, device=x.device)  # a list only on the greedy path: its one small copy
    x[rows] = x[rows].masked_fill_(banned, float("-inf"))
    return x


def _to_device(h: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """One float64 buffer (ids are exact in it), one host-to-device copy, one conversion per dtype.

    From pinned memory the copy doesn't wait for the stream (the caching host allocator keeps it alive)."""
    buf = torch.from_numpy(np.concatenate(list(h.values())))
    buf = buf.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else buf.to(device)
    groups = ((_LONG, torch.long), (_FLOAT, torch.float32), (_DOUBLE, torch.float64))
    d = {}
    for part, (keys, dtype) in zip(buf.split([sum(len(h[k]) for k in g) for g, _ in groups]), groups, strict=True):
        d.update(zip(keys, part.to(dtype).split([len(h[k]) for k in keys]), strict=True))
    return d


def _adjust(logits: torch.Tensor, d: dict[str, torch.Tensor]) -> torch.Tensor:
    """A copy with logit_bias, then the repetition, frequency and presence penalties, in CPU arithmetic."""
    x = logits.clone()
    if len(d["b_row"]):
        x[d["b_row"], d["b_id"]] += d["b_val"]
    if len(d["r_row"]):
        # The penalty as a float32 tensor, not a Python scalar: numpy divides by float32(penalty), and
        # CUDA would turn division by a scalar into multiplication by its reciprocal.
        r, t = d["r_row"], d["r_id"]
        v, pen = x[r, t], d["rep"][r]
        x[r, t] = torch.where(v > 0, v / pen, v * pen)
    if len(d["f_row"]):
        r, t = d["f_row"], d["f_id"]
        sub = d["fp"][r] * d["f_cnt"] + d["pp"][r]  # float64, as numpy's fp * counts + pp
        x[r, t] = (x[r, t].double() - sub).float()  # numpy subtracts in float64, stores float32
    return x


def _cumsum(w: torch.Tensor) -> torch.Tensor:
    """float64 cumulative sums along rows, blockwise (the same sums up to rounding, many times faster).

    Rows come back padded to whole blocks, the padding holding the row's total."""
    n, vocab = w.shape
    x = F.pad(w.double(), (0, -vocab % _BLOCK)).view(n, -1, _BLOCK).cumsum(2)
    before = F.pad(x[:, :-1, -1].cumsum(1), (1, 0))
    return (x + before[:, :, None]).view(n, -1)


def _top_p(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but the smallest best-first prefix (ties: lower id first) whose mass reaches top_p."""
    sw, order = w.sort(dim=1, descending=True, stable=True)
    cum = _cumsum(sw)
    target = top_p[:, None] * cum[:, -1:] * (1 - TOP_P_SLACK)
    short = (cum < target).sum(1, keepdim=True)  # the prefix: these and the one that reaches target
    pos = torch.arange(w.shape[1], device=w.device)
    return torch.zeros_like(w).scatter_(1, order, torch.where(pos <= short, sw, 0))


def _draw(x: torch.Tensor, argmax: torch.Tensor, d: dict[str, torch.Tensor], kmax: int, top_p: bool) -> torch.Tensor:
    """One token per row of adjusted logits: temperature, top_k, top_p, min_p, inverse CDF in id order."""
    vocab = x.shape[1]
    best = x.amax(1, keepdim=True)
    finite = best.isfinite()  # else all masked, or an infinite logit: nothing to weigh, take the argmax
    x, best = torch.where(finite, x, 0), torch.where(finite, best, 0)
    w = torch.exp((x - best) / d["temp"][:, None])  # float32 tensor: a true division, as numpy's
    if kmax:
        k = d["top_k"][:, None]
        kth = x.topk(kmax, dim=1).values.gather(1, (k - 1).clamp(min=0))
        w = torch.where((x >= kth) | (k == 0), w, 0)  # every tie with the k-th largest stays
    if top_p:
        rows = d["p_row"]
        w[rows] = _top_p(w[rows], d["top_p"][rows])
    w = torch.where(w >= d["min_p"][:, None], w, 0)  # numpy compares in float32 too
    cdf = _cumsum(w)
    j = torch.searchsorted(cdf, d["u"][:, None] * cdf[:, -1:], right=True)[:, 0]
    # Rounding can put the target past the end: take the last token that has any weight.
    last = torch.where(w > 0, torch.arange(vocab, device=x.device), -1).amax(1)
    return torch.where(finite[:, 0], torch.where(j < vocab, j, last), argmax)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Log-softmax of the raw logits at `tokens`, and the top k (id, logprob), best first."""
    best = raw.amax(1, keepdim=True)
    lse = best.double() + (raw - best).exp().double().sum(1, keepdim=True).log()
    chosen = raw.gather(1, tokens[:, None]).double() - lse
    if not k:
        return chosen[:, 0], chosen[:, :0], chosen[:, :0]
    # An int64 key, float32 order in the high half and reversed id in the low: topk then ranks ties
    # by lower id, as the CPU's stable sort does.
    bits = raw.view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, -(2**31) - bits)  # sign-magnitude to two's complement
    key = ordered * 2**32 + (2**32 - 1 - torch.arange(raw.shape[1], device=raw.device))
    ids = key.topk(k, dim=1).indices
    return chosen[:, 0], ids, raw.gather(1, ids).double() - lse


class PendingSample:
    """Tokens (and logprobs) sampled on the device, on their way to pinned host memory; `result()` waits."""

    __slots__ = ("host", "event", "n", "lrows", "ks", "k")

    def __init__(self, flat: torch.Tensor, n: int, lrows: list[int], ks: list[int], k: int):
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = flat, None
        self.n, self.lrows, self.ks, self.k = n, lrows, ks, k

    def result(self) -> list[SampleResult]:
        if self.event is not None:
            self.event.synchronize()
        flat, n, k = self.host.tolist(), self.n, self.k
        results = [SampleResult(int(t)) for t in flat[:n]]
        nl = len(self.lrows)
        chosen, top_ids, top_vals = flat[n:n + nl], flat[n + nl:n + nl + nl * k], flat[n + nl + nl * k:]
        for j, (i, ki) in enumerate(zip(self.lrows, self.ks, strict=True)):
            top = [(int(top_ids[j * k + c]), top_vals[j * k + c]) for c in range(min(ki, k))]
            results[i] = SampleResult(results[i].token, chosen[j], top)
        return results


class TorchSampler:
    """Samples one token per row on the logits' device; row i belongs to inputs[i]. Never writes to the logits."""

    def __init__(self):
        self._stage = _MaskStage()

    def __call__(self, logits: torch.Tensor, inputs: Sequence[SamplerInput]) -> list[SampleResult]:
        return self.launch(logits, inputs)[1].result()

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, inputs: Sequence[SamplerInput]) -> tuple[torch.Tensor, PendingSample]:
        """(the tokens [n] on the device, their read-back): nothing here waits for the device."""
        if logits.ndim != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(inputs)} inputs")
        params = [s.params for s in inputs]
        adjusts = any(adjusts_logits(p) for p in params)
        masked = [i for i, s in enumerate(inputs) if getattr(s, "token_mask", None) is not None]  # rows, in order
        n, vocab = logits.shape
        if not adjusts and all(p.greedy and p.logprobs is None for p in params):
            if masked:  # greedy rows under token masks (a JSON schema's usual case): the masked argmax alone
                words = self._stage.to_device(inputs, masked, logits.device)
                logits = _apply_masks(logits.to(torch.float32, copy=True), masked, words)
            # 16-bit logits compare as their exact fp32 values do: no conversion pass before a plain argmax
            tokens = argmax_rows(logits)
            return tokens, PendingSample(tokens, n, [], [], 0)
        logits = logits.float()
        h = _host_arrays(inputs, vocab)
        d = _to_device(h, logits.device)
        x = _adjust(logits, d) if adjusts else logits
        if masked:  # after the logit processors, before temperature and the cuts (vLLM's place)
            words = self._stage.to_device(inputs, masked, logits.device)
            x = _apply_masks(x if adjusts else x.clone(), d["m_row"], words)
        tokens = argmax_rows(x)  # greedy rows; sampled rows are overwritten below
        if len(h["s_row"]):
            rows = d["s_row"]
            xs = x if len(rows) == n else x[rows]
            tokens[rows] = _draw(xs, tokens[rows], d, int(h["top_k"].max()), len(h["p_row"]) > 0)
        out = [tokens.double()]
        lrows = h["l_row"].astype(np.int64).tolist()
        ks = [params[i].logprobs for i in lrows]
        k = min(max(ks, default=0), vocab)
        if lrows:
            out += [t.flatten() for t in _logprobs(logits[d["l_row"]], tokens[d["l_row"]], k)]
        return tokens, PendingSample(torch.cat(out), n, lrows, ks, k)  # one device-to-host copy
