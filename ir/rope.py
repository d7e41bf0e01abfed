"""Rotary position embedding: the spec carried by the IR's `rope` op and its frequency tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RopeSpec:
    """`style` "neox" rotates (x[i], x[i + d/2]) pairs (HF layout); "interleaved" rotates
    (x[2i], x[2i+1]) pairs (GPT-J / ggml "normal" layout). `scaling` holds the HF rope_parameters
    beyond theta (rope_type, factor, ...); `freq_factors` are GGUF's per-frequency divisors. "longrope" holds two
    tables, short and long factors, and picks one per token by the length of the token's sequence (`long_after`)."""

    theta: float
    rotary_dim: int
    style: str = "neox"
    scaling: tuple[tuple[str, object], ...] = ()
    freq_factors: tuple[float, ...] | None = field(default=None)

    @property
    def rope_type(self) -> str:
        return str(dict(self.scaling).get("rope_type", "default"))

    def __str__(self) -> str:
        extra = f", {self.rope_type}" if self.rope_type != "default" else ""
        return f"rope(theta={self.theta:g}, dim={self.rotary_dim}, {self.style}{extra})"


def longrope(theta: float, rotary_dim: int, short_factor, long_factor, original_max_position_embeddings: int,
             attention_factor: float) -> RopeSpec:
    """A longrope (Phi-3's "su") spec; the attention factor scales cos/sin of both tables, as in transformers."""
    for name, f in (("short_factor", short_factor), ("long_factor", long_factor)):
        if len(f) != rotary_dim // 2:
            raise ValueError(f"longrope {name} has {len(f)} entries; rotary_dim {rotary_dim} needs {rotary_dim // 2}")
    scaling = {"rope_type": "longrope", "short_factor": tuple(float(x) for x in short_factor),
               "long_factor": tuple(float(x) for x in long_factor),
               "original_max_position_embeddings": int(original_max_position_embeddings),
               "attention_factor": float(attention_factor)}
    return RopeSpec(theta=float(theta), rotary_dim=int(rotary_dim), scaling=tuple(sorted(scaling.items())))


def long_after(spec: RopeSpec) -> int | None:
    """longrope: the tokens of a sequence longer than this (its length once the step's tokens are in) take the long
    factors, the others the short ones. transformers' rotary rule (seq_len = max(position_ids) + 1 >
    original_max_position_embeddings, per forward), per sequence of a varlen batch: a prompt prefilled in one step
    takes the table its length picks; a decode step past the limit switches to the long table for its new tokens,
    keys already cached keep theirs. (transformers' generate() for phi3 then also drops the cache once and recomputes
    the sequence on the long table; that is an engine-level recompute we do not do.) None for every other kind."""
    if spec.rope_type != "longrope":
        return None
    return int(dict(spec.scaling)["original_max_position_embeddings"])


def token_seq_lens(context_lens: np.ndarray, query_start: np.ndarray) -> np.ndarray:
    """Each token's sequence length after the step (core.batch's context_lens, spread over the sequence's tokens)."""
    return np.repeat(np.asarray(context_lens), np.diff(np.asarray(query_start)))


def inv_freq(spec: RopeSpec, long: bool = False) -> tuple[np.ndarray, float]:
    """Inverse frequencies (fp32, like transformers) and the attention factor applied to cos/sin; `long` picks
    longrope's long factors."""
    dim = spec.rotary_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    base = 1.0 / (spec.theta ** exponents)
    base = base.astype(np.float32)
    p = dict(spec.scaling)
    kind = spec.rope_type
    factor = float(p.get("factor", 1.0) or 1.0)
    attn_factor = 1.0
    if spec.freq_factors is not None:
        base = base / np.asarray(spec.freq_factors, dtype=np.float32)
    if kind in ("default", "freq_factors"):
        pass
    elif kind == "linear":
        base = base / np.float32(factor)
    elif kind == "llama3":
        base = _llama3(base, p, factor)
    elif kind == "yarn":
        base, attn_factor = _yarn(base, p, factor, spec)
    elif kind == "longrope":
        ext = np.asarray(p["long_factor" if long else "short_factor"], dtype=np.float32)
        base = 1.0 / (ext * spec.theta ** exponents)
        attn_factor = float(p["attention_factor"])
    else:
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3, yarn, longrope)")
    return base.astype(np.float32), attn_factor


def _llama3(inv: np.ndarray, p: dict, factor: float) -> np.ndarray:
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(inv: np.ndarray, p: dict, factor: float, spec: RopeSpec) -> tuple[np.ndarray, float]:
    dim = spec.rotary_dim
    old_ctx = float(p.get("original_max_position_embeddings") or 4096)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as the reference implementations do
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    out = (inv / factor) * (1 - extrapolation) + inv * extrapolation

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return out.astype(np.float32), float(attn)


def cos_sin(spec: RopeSpec, positions: np.ndarray, seq_lens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [T, rotary_dim // 2] for integer positions. `seq_lens` (each token's sequence length,
    see token_seq_lens) picks longrope's table per token; other kinds ignore it."""
    inv, attn = inv_freq(spec)
    inv = np.broadcast_to(inv.astype(np.float64), (len(positions), len(inv)))
    limit = long_after(spec)
    if limit is not None:
        if seq_lens is None:
            raise ValueError("longrope picks its table by each token's sequence length: cos_sin needs seq_lens")
        long = np.asarray(seq_lens)[:, None] > limit
        inv = np.where(long, inv_freq(spec, long=True)[0].astype(np.float64)[None, :], inv)
    angles = positions.astype(np.float64)[:, None] * inv
    return (np.cos(angles) * attn).astype(np.float32), (np.sin(angles) * attn).astype(np.float32)
