"""phi-1 / 1.5 / 2 (PhiForCausalLM; GGUF "phi2"): one LayerNorm feeds attention and MLP in parallel
(h = h + attn(ln(h)) + mlp(ln(h))), biases everywhere (the lm_head too), partial rotary (0.5 unless the config says),
gelu_new, a plain fc1/fc2 MLP, optional per-head LayerNorms on q and k (qk_layernorm)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ir.config import ModelConfig, gguf_fields, hf_fields
from ir.graph import Graph, Value
from ir.models import Architecture
from ir.models._decoder import embed, layer_norm, logits, step_inputs
from ir.models._names import layer_names
from ir.models.llama import dense
from ir.models.phi3 import split_rows
from ir.rope import long_after
from ir.weights import StoredTensor, WeightSource

LAYER_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "attn_norm_b": ("model.layers.{i}.input_layernorm.bias", "blk.{i}.attn_norm.bias"),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    "q_norm": ("model.layers.{i}.self_attn.q_layernorm.weight", "blk.{i}.attn_q_norm.weight"),
    "q_norm_b": ("model.layers.{i}.self_attn.q_layernorm.bias", "blk.{i}.attn_q_norm.bias"),
    "k_norm": ("model.layers.{i}.self_attn.k_layernorm.weight", "blk.{i}.attn_k_norm.weight"),
    "k_norm_b": ("model.layers.{i}.self_attn.k_layernorm.bias", "blk.{i}.attn_k_norm.bias"),
    "wo": ("model.layers.{i}.self_attn.dense.weight", "blk.{i}.attn_output.weight"),
    "bo": ("model.layers.{i}.self_attn.dense.bias", "blk.{i}.attn_output.bias"),
    "w_up": ("model.layers.{i}.mlp.fc1.weight", "blk.{i}.ffn_up.weight"),
    "b_up": ("model.layers.{i}.mlp.fc1.bias", "blk.{i}.ffn_up.bias"),
    "w_down": ("model.layers.{i}.mlp.fc2.weight", "blk.{i}.ffn_down.weight"),
    "b_down": ("model.layers.{i}.mlp.fc2.bias", "blk.{i}.ffn_down.bias"),
}
TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.final_layernorm.weight", "output_norm.weight"),
    "final_norm_b": ("model.final_layernorm.bias", "output_norm.bias"),
    "lm_head": ("lm_head.weight", "output.weight"),
    "lm_head_b": ("lm_head.bias", "output.bias"),
}


@dataclass(frozen=True)
class PhiConfig(ModelConfig):
    layer_norm_eps: float = 1e-5  # every norm is a LayerNorm; qk_norm means HF's qk_layernorm

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> PhiConfig:  # noqa: B006
        kw = hf_fields(hf, arch, defaults)
        if "partial_rotary_factor" not in hf and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
            kw["rope"] = replace(kw["rope"], rotary_dim=int(kw["head_dim"] * 0.5))  # PhiConfig's default
        return cls(**kw | {"qk_norm": bool(hf.get("qk_layernorm", False))},
                   layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors: tuple[float, ...] | None = None  # noqa: B006
                  ) -> PhiConfig:
        """llama.cpp's phi2 graph: gelu (its tanh form, which is gelu_new), LayerNorm eps from layer_norm_epsilon."""
        kw = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        eps = meta.get(f"{meta['general.architecture']}.attention.layer_norm_epsilon", 1e-5)
        return cls(**kw | {"hidden_act": "gelu_tanh"}, layer_norm_eps=float(eps))


def load_weights(cfg: PhiConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    """By name; a GGUF converted from the original (mixformer) phi-2 checkpoint holds q/k/v as one attn_qkv."""
    out: dict[str, StoredTensor] = {}
    if src.format == "gguf" and "blk.0.attn_qkv.weight" in src:
        d = cfg.head_dim
        sizes = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        for i in range(cfg.num_layers):
            for kind, params in (("weight", ("wq", "wk", "wv")), ("bias", ("bq", "bk", "bv"))):
                parts = split_rows(src, f"blk.{i}.attn_qkv.{kind}", sizes, f"layers.{i}.{params[0]}")
                out.update({f"layers.{i}.{p}": t for p, t in zip(params, parts, strict=True)})
    names = layer_names(LAYER_NAMES, TOP_NAMES, cfg.num_layers, src.format)
    out.update({p: src.require(names[p], p) for p in graph.params if p not in out})
    return out


def _attention(g: Graph, cfg: PhiConfig, x: Value, i: int, pos: Value, meta: list[Value]) -> Value:
    p, d = f"layers.{i}", cfg.head_dim
    hq, hkv, h = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    q = g.reshape(dense(g, x, p, hq * d, h, True, "column", "wq", "bq"), shape=("T", hq, d))
    k = g.reshape(dense(g, x, p, hkv * d, h, True, "column", "wk", "bk"), shape=("T", hkv, d))
    v = g.reshape(dense(g, x, p, hkv * d, h, True, "column", "wv", "bv"), shape=("T", hkv, d))
    if cfg.qk_norm:
        q = layer_norm(g, q, f"{p}.q_norm", d, cfg.layer_norm_eps)
        k = layer_norm(g, k, f"{p}.k_norm", d, cfg.layer_norm_eps)
    seq = meta[2:] if long_after(cfg.rope) is not None else ()
    q = g.rope(q, pos, *seq, spec=cfg.rope)
    k = g.rope(k, pos, *seq, spec=cfg.rope)
    o = g.attention(q, k, v, *meta, layer=i, scale=d**-0.5, sliding_window=cfg.window_for(i))
    return dense(g, g.reshape(o, shape=("T", hq * d)), p, h, hq * d, True, "row", "wo", "bo")


def _mlp(g: Graph, cfg: PhiConfig, x: Value, i: int) -> Value:
    p, h, f = f"layers.{i}", cfg.hidden_size, cfg.intermediate_size
    up = dense(g, x, p, f, h, True, "column", "w_up", "b_up")
    return dense(g, g.op(cfg.hidden_act, up), p, h, f, True, "row", "w_down", "b_down")


def build(cfg: PhiConfig, dtype: str = "f32") -> Graph:
    """One forward step over a flat varlen batch; logits for `logits_indices`."""
    g = Graph(cfg.arch, dtype)
    s = step_inputs(g)
    h, table = embed(g, cfg, s.ids)
    for i in range(cfg.num_layers):
        x = layer_norm(g, h, f"layers.{i}.attn_norm", cfg.hidden_size, cfg.layer_norm_eps)
        # transformers' order of the sums: attn + mlp, then the residual
        h = g.add(g.add(_attention(g, cfg, x, i, s.positions, s.attention), _mlp(g, cfg, x, i)), h)
    h = layer_norm(g, h, "final_norm", cfg.hidden_size, cfg.layer_norm_eps)
    g.output("logits", logits(g, cfg, h, table, s.logits_rows, bias=True))
    return g


ARCH = Architecture(
    name="phi",
    hf_model_types=("phi",),
    gguf_archs=("phi2",),
    build=build,
    load_weights=load_weights,
    config_cls=PhiConfig,
    # every linear of phi carries a bias; HF's PhiConfig has no flags for them
    defaults={"qkv_bias": True, "o_bias": True, "mlp_bias": True},
)
