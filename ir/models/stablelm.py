"""stablelm (StableLM-2, StableLM-3B-4E1T, stablelm-zephyr): LayerNorms with biases, neox rotary on the first
quarter of each head (partial_rotary_factor), and three flags: q/k/v biases (use_qkv_bias), per-head q/k LayerNorms
(qk_layernorm: one LayerNorm a head, no bias; StableLM-2-12B) and GPT-NeoX's parallel residual
(use_parallel_residual: h + attn(ln(h)) + mlp(ln(h)), one norm a layer)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ir.config import ModelConfig, gguf_fields, hf_fields, hf_rope
from ir.graph import Graph, Value
from ir.models import Architecture, llama
from ir.models._decoder import embed, layer_norm, logits, step_inputs
from ir.models._names import layer_names
from ir.weights import StoredTensor, WeightSource

PARTIAL_ROTARY = 0.25  # transformers' StableLmConfig default, for configs that do not say


@dataclass(frozen=True)
class StableLmConfig(ModelConfig):
    layer_norm_eps: float = 1e-5
    parallel_residual: bool = False  # qk_norm (inherited) means the per-head LayerNorms here

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}  # noqa: B006
                ) -> StableLmConfig:
        f = hf_fields(hf, arch, defaults)
        # transformers' stablelm derives head_dim from hidden / heads whatever the config says.
        head_dim = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
        return cls(**f | dict(
            head_dim=head_dim,
            rope=hf_rope({"partial_rotary_factor": PARTIAL_ROTARY, **hf}, head_dim),
            qkv_bias=bool(hf.get("use_qkv_bias", False)), o_bias=False, mlp_bias=False,
            qk_norm=bool(hf.get("qk_layernorm", False)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
            parallel_residual=bool(hf.get("use_parallel_residual", False))))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors: tuple[float, ...] | None = None  # noqa: B006
                  ) -> StableLmConfig:
        f = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        a = meta["general.architecture"]
        # The tensors describe the layer, as llama.cpp's graph reads it: no ffn_norm means the parallel residual.
        return cls(**f | dict(layer_norm_eps=float(meta.get(f"{a}.attention.layer_norm_epsilon", 1e-5)),
                              parallel_residual="blk.0.ffn_norm.weight" not in tensors))


LAYER_NAMES = {k: v for k, v in llama.LAYER_NAMES.items() if k not in ("q_norm", "k_norm")} | {
    "attn_norm_b": ("model.layers.{i}.input_layernorm.bias", "blk.{i}.attn_norm.bias"),
    "ffn_norm_b": ("model.layers.{i}.post_attention_layernorm.bias", "blk.{i}.ffn_norm.bias"),
    "q_norm": ("", "blk.{i}.attn_q_norm.weight"),  # HF: one tensor a head, stacked by load_weights
    "k_norm": ("", "blk.{i}.attn_k_norm.weight"),
}
TOP_NAMES = llama.TOP_NAMES | {"final_norm_b": ("model.norm.bias", "output_norm.bias")}
HF_HEAD_NORMS = {"q_norm": "q_layernorm", "k_norm": "k_layernorm"}


def _stacked_heads(src: WeightSource, layer: int, module: str, heads: int) -> StoredTensor:
    """transformers' per-head LayerNorm weights of one layer as one [heads, head_dim] tensor, as llama.cpp's
    converter stacks them."""
    pattern = f"model.layers.{layer}.self_attn.{module}.norms.{{}}.weight"
    parts = [src.require(pattern.format(h)).values().astype(np.float32) for h in range(heads)]
    data = np.stack(parts)
    return StoredTensor(data, "F32", data.shape, pattern.format("*"))


def load_weights(cfg: ModelConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    """By name (llama.cpp does not permute stablelm's q/k); HF's per-head q/k norms stacked."""
    fmt = src.format
    names = layer_names(LAYER_NAMES, TOP_NAMES, cfg.num_layers, fmt)
    out = {}
    for p in graph.params:
        key = p.rsplit(".", 1)[-1]
        if fmt == "hf" and key in HF_HEAD_NORMS:
            layer, heads = int(p.split(".")[1]), graph.params[p].shape[0]
            out[p] = _stacked_heads(src, layer, HF_HEAD_NORMS[key], heads)
        else:
            out[p] = src.require(names.get(p, p), p)
    return out


def _norm(g: Graph, cfg: StableLmConfig, x: Value, name: str) -> Value:
    return layer_norm(g, x, name, cfg.hidden_size, cfg.layer_norm_eps)


def _attention(g: Graph, cfg: StableLmConfig, x: Value, i: int, pos: Value, meta: list[Value]) -> Value:
    p, d = f"layers.{i}", cfg.head_dim
    hq, hkv, h = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    q = g.reshape(llama.dense(g, x, p, hq * d, h, cfg.qkv_bias, "column", "wq", "bq"), shape=("T", hq, d))
    k = g.reshape(llama.dense(g, x, p, hkv * d, h, cfg.qkv_bias, "column", "wk", "bk"), shape=("T", hkv, d))
    v = g.reshape(llama.dense(g, x, p, hkv * d, h, cfg.qkv_bias, "column", "wv", "bv"), shape=("T", hkv, d))
    if cfg.qk_norm:  # a LayerNorm of each head's own weights, before rope
        q = g.layer_norm(q, g.param(f"{p}.q_norm", (hq, d), shard="column"), eps=cfg.layer_norm_eps)
        k = g.layer_norm(k, g.param(f"{p}.k_norm", (hkv, d), shard="column"), eps=cfg.layer_norm_eps)
    q = g.rope(q, pos, spec=cfg.rope)
    k = g.rope(k, pos, spec=cfg.rope)
    o = g.attention(q, k, v, *meta, layer=i, scale=d**-0.5, sliding_window=cfg.window_for(i))
    return llama.dense(g, g.reshape(o, shape=("T", hq * d)), p, h, hq * d, False, "row", "wo", "bo")


def build(cfg: StableLmConfig, dtype: str = "f32") -> Graph:
    g = Graph(cfg.arch, dtype)
    s = step_inputs(g)
    h, table = embed(g, cfg, s.ids)
    for i in range(cfg.num_layers):
        x = _norm(g, cfg, h, f"layers.{i}.attn_norm")
        attn = _attention(g, cfg, x, i, s.positions, s.attention)
        if cfg.parallel_residual:  # transformers adds (h + attn) + mlp, in that order
            h = g.add(g.add(h, attn), llama.mlp_block(g, cfg, x, i))
        else:
            h = g.add(h, attn)
            h = g.add(h, llama.mlp_block(g, cfg, _norm(g, cfg, h, f"layers.{i}.ffn_norm"), i))
    g.output("logits", logits(g, cfg, _norm(g, cfg, h, "final_norm"), table, s.logits_rows))
    return g


ARCH = Architecture(
    name="stablelm",
    hf_model_types=("stablelm",),
    gguf_archs=("stablelm",),
    build=build,
    load_weights=load_weights,
    config_cls=StableLmConfig,
)
