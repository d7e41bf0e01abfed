"""Rotary position embedding: the spec carried by the IR's `rope` op and its frequency tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RopeSpec:
    """`style` "neox" rotates (x[i], x[i + d/2]) pairs (HF layout); "interleaved" rotates
    (x[2i], x[2i+1]) pairs (GPT-J / ggml "normal" layout). `scaling` holds the HF rope_parameters
    beyond theta (rope_type, factor, ...); `freq_factors` are GGUF's per-frequency divisors."""

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


def inv_freq(spec: RopeSpec) -> tuple[np.ndarray, float]:
    """Inverse frequencies (fp32, like transformers) and the attention factor applied to cos/sin."""
    dim = spec.rotary_dim
    base = 1.0 / (spec.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
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
    else:
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3, yarn)")
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


def cos_sin(spec: RopeSpec, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [T, rotary_dim // 2] for integer positions."""
    inv, attn = inv_freq(spec)
    angles = positions.astype(np.float64)[:, None] * inv.astype(np.float64)[None, :]
    return (np.cos(angles) * attn).astype(np.float32), (np.sin(angles) * attn).astype(np.float32)
