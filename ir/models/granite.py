"""IBM Granite 3.x (GraniteForCausalLM): llama's decoder with four scalars, read from config.json's multipliers or
GGUF's granite.*_scale keys. Embeddings are multiplied by embedding_multiplier, each block's output by
residual_multiplier before it joins the residual stream, attention scores scale by attention_multiplier instead of
head_dim ** -0.5, and logits are divided by logits_scaling. llama.cpp converts it as llama (q/k rows permuted)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ir.config import ModelConfig, gguf_fields, hf_fields
from ir.graph import Graph
from ir.models import Architecture, llama
from ir.models._decoder import embed, logits, step_inputs


@dataclass(frozen=True)
class GraniteConfig(ModelConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # None: head_dim ** -0.5
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> GraniteConfig:  # noqa: B006
        return cls(**hf_fields(hf, arch, defaults),
                   embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                   attention_multiplier=float(hf["attention_multiplier"]) if hf.get("attention_multiplier") else None,
                   logits_scaling=float(hf.get("logits_scaling", 1.0)))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors=None) -> GraniteConfig:  # noqa: B006
        a = meta["general.architecture"]
        # The converter writes each scale only when the multiplier is set (non-zero): absent means 1 / default.
        attn = meta.get(f"{a}.attention.scale")
        return cls(**gguf_fields(meta, tensors, arch, defaults, freq_factors),
                   embedding_multiplier=float(meta.get(f"{a}.embedding_scale", 1.0)),
                   residual_multiplier=float(meta.get(f"{a}.residual_scale", 1.0)),
                   attention_multiplier=float(attn) if attn else None,
                   logits_scaling=float(meta.get(f"{a}.logit_scale", 1.0)))


def build(cfg: GraniteConfig, dtype: str = "f32") -> Graph:
    g = Graph(cfg.arch, dtype)
    s = step_inputs(g)
    h, table = embed(g, cfg, s.ids)
    h = g.scale(h, factor=cfg.embedding_multiplier)
    for i in range(cfg.num_layers):
        x = g.rms_norm(h, g.param(f"layers.{i}.attn_norm", (cfg.hidden_size,)), eps=cfg.rms_norm_eps)
        o = llama.attention_block(g, cfg, x, i, s.positions, s.attention, scale=cfg.attention_multiplier)
        h = g.add(h, g.scale(o, factor=cfg.residual_multiplier))
        x = g.rms_norm(h, g.param(f"layers.{i}.ffn_norm", (cfg.hidden_size,)), eps=cfg.rms_norm_eps)
        h = g.add(h, g.scale(llama.mlp_block(g, cfg, x, i), factor=cfg.residual_multiplier))
    h = g.rms_norm(h, g.param("final_norm", (cfg.hidden_size,)), eps=cfg.rms_norm_eps)
    g.output("logits", g.scale(logits(g, cfg, h, table, s.logits_rows), factor=1.0 / cfg.logits_scaling))
    return g


ARCH = Architecture(
    name="granite",
    hf_model_types=("granite",),
    gguf_archs=("granite",),
    build=build,
    load_weights=llama.load_weights,  # llama's tensor names; GGUF q/k rows permuted as llama's
    config_cls=GraniteConfig,
)
