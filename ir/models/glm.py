"""GLM-4: glm4 (GLM-4-9B-0414, GLM-Z1) and glm (GLM-4-9B-chat-hf; llama.cpp's "chatglm" GGUF). Both are llama
decoders with q/k/v biases (no o_proj bias), a fused gate_up_proj, and rotary on the first half of each head over
interleaved pairs (x[2i], x[2i+1]), ggml's "normal" rope, so llama.cpp converts them without a q/k permutation.
glm4 adds two norms a layer, each on a sub-block's output before its residual add:
h = h + post_self_attn_norm(attn(input_norm(h))); h = h + post_mlp_norm(mlp(post_attention_norm(h)))."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ir.config import ModelConfig, gguf_fields, hf_fields
from ir.formats.errors import ModelFormatError
from ir.graph import Graph
from ir.models import Architecture, llama
from ir.models._decoder import embed, logits, step_inputs
from ir.models._names import layer_names
from ir.weights import StoredTensor, WeightSource

PARTIAL_ROTARY = 0.5  # transformers' GlmConfig / Glm4Config default, for configs that do not say


@dataclass(frozen=True)
class GlmConfig(ModelConfig):
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}  # noqa: B006
                ) -> GlmConfig:
        f = hf_fields({"partial_rotary_factor": PARTIAL_ROTARY, **hf}, arch, defaults)
        # attention_bias (default True) gives q/k/v biases only: o_proj never has one.
        return cls(**f | dict(rope=replace(f["rope"], style="interleaved"), o_bias=False,
                              qkv_bias=bool(hf.get("attention_bias", True))))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors: tuple[float, ...] | None = None  # noqa: B006
                  ) -> GlmConfig:
        a = meta["general.architecture"]
        if f"{a}.rope.dimension_sections" in meta:
            raise ValueError("M-RoPE sections (GLM-4V's text model, its q/k permuted to neox) are not supported")
        f = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        # ChatGLM's own checkpoints keep q/k/v fused: attn_qkv.
        qkv_bias = f.get("qkv_bias", False) or "blk.0.attn_qkv.bias" in tensors
        return cls(**f | dict(rope=replace(f["rope"], style="interleaved"), qkv_bias=qkv_bias))


LAYER_NAMES = {k: v for k, v in llama.LAYER_NAMES.items() if k not in ("w_gate", "w_up", "b_gate", "b_up")} | {
    "attn_post_norm": ("model.layers.{i}.post_self_attn_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    "ffn_post_norm": ("model.layers.{i}.post_mlp_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
}
# Fused in both formats (llama.cpp keeps gate_up_proj as ffn_up: gate rows first, as its swiglu splits it).
GATE_UP = ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight")
QKV = "blk.{i}.attn_qkv.{kind}"  # GGUF files converted from ChatGLM's own checkpoints


def _split(src: WeightSource, t: StoredTensor, sizes: dict[str, int]) -> dict[str, StoredTensor]:
    if t.shape[0] != sum(sizes.values()):
        raise ModelFormatError(src.path, f"{t.source!r} has {t.shape[0]} rows; the config implies "
                               f"{' + '.join(f'{v} ({k})' for k, v in sizes.items())}")
    out, start = {}, 0
    for key, n in sizes.items():
        out[key], start = t.rows(start, start + n), start + n
    return out


def load_weights(cfg: ModelConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    """By name, no q/k permutation; gate_up_proj (and a GGUF attn_qkv) split by rows."""
    which = 0 if src.format == "hf" else 1
    names = layer_names(LAYER_NAMES, llama.TOP_NAMES, cfg.num_layers, src.format)
    split: dict[str, StoredTensor] = {}
    f, d = cfg.intermediate_size, cfg.head_dim
    qkv = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
    for i in range(cfg.num_layers):
        gate_up = src.require(GATE_UP[which].format(i=i), f"layers.{i}.w_gate")
        split |= {f"layers.{i}.{k}": t for k, t in _split(src, gate_up, {"w_gate": f, "w_up": f}).items()}
        for kind, prefix in (("weight", "w"), ("bias", "b")):
            if which == 1 and QKV.format(i=i, kind=kind) in src:
                fused = src.require(QKV.format(i=i, kind=kind))
                split |= {f"layers.{i}.{prefix}{k}": t for k, t in _split(src, fused, qkv).items()}
    return {p: split[p] if p in split else src.require(names.get(p, p), p) for p in graph.params}


def build(cfg: ModelConfig, dtype: str = "f32", post_norms: bool = True) -> Graph:
    g = Graph(cfg.arch, dtype)
    s = step_inputs(g)
    h, table = embed(g, cfg, s.ids)

    def norm(x, name):
        return g.rms_norm(x, g.param(name, (cfg.hidden_size,)), eps=cfg.rms_norm_eps)

    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        attn = llama.attention_block(g, cfg, norm(h, f"{p}.attn_norm"), i, s.positions, s.attention)
        h = g.add(h, norm(attn, f"{p}.attn_post_norm") if post_norms else attn)
        mlp = llama.mlp_block(g, cfg, norm(h, f"{p}.ffn_norm"), i)
        h = g.add(h, norm(mlp, f"{p}.ffn_post_norm") if post_norms else mlp)
    g.output("logits", logits(g, cfg, norm(h, "final_norm"), table, s.logits_rows))
    return g


ARCHS = (
    Architecture(name="glm4", hf_model_types=("glm4",), gguf_archs=("glm4",), build=build,
                 load_weights=load_weights, config_cls=GlmConfig),
    Architecture(name="glm", hf_model_types=("glm",), gguf_archs=("chatglm",), build=partial(build, post_norms=False),
                 load_weights=load_weights, config_cls=GlmConfig),
)
