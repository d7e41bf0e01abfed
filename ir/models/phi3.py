"""phi-3 / 3.5 / 4 (Phi3ForCausalLM; phi-4 and phi-4-mini use it too): the llama decoder with fused qkv_proj and
gate_up_proj (split here into the graph's q/k/v and gate/up parameters), longrope ("su") rope scaling, partial rotary
(phi-4-mini) and a sliding window on every layer when the config sets one."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ir.config import ModelConfig, gguf_fields, hf_fields
from ir.formats.errors import ModelFormatError
from ir.graph import Graph
from ir.models import Architecture, llama
from ir.models._names import layer_names
from ir.rope import RopeSpec, longrope
from ir.weights import StoredTensor, WeightSource

# IR parameter -> (HF name, GGUF name) for the tensors bound one to one.
LAYER_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
}
TOP_NAMES = llama.TOP_NAMES
# Fused tensors -> the parameters they hold, by output rows in this order (llama.cpp keeps them fused too:
# attn_qkv, and ffn_up holding gate then up).
FUSED = {
    ("model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight"): ("wq", "wk", "wv"),
    ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight"): ("w_gate", "w_up"),
}


def split_rows(src: WeightSource, name: str, sizes: list[int], param: str) -> list[StoredTensor]:
    """Consecutive output-row blocks of a fused tensor (weight or bias; quantized blocks split as they lie)."""
    t = src.require(name, param)
    if sum(sizes) != t.shape[0]:
        raise ModelFormatError(src.path, f"tensor {name!r} has {t.shape[0]} rows; the config implies {sum(sizes)} "
                               f"({' + '.join(map(str, sizes))})")
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    return [t.rows(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def part_sizes(cfg: ModelConfig, params: tuple[str, ...]) -> list[int]:
    q, kv, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return [{"wq": q, "wk": kv, "wv": kv, "w_gate": ff, "w_up": ff}[p] for p in params]


def load_weights(cfg: ModelConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    """The fused tensors split into their parameters, the rest by name."""
    which = 0 if src.format == "hf" else 1
    out: dict[str, StoredTensor] = {}
    for i in range(cfg.num_layers):
        for names, params in FUSED.items():
            parts = split_rows(src, names[which].format(i=i), part_sizes(cfg, params), f"layers.{i}.{params[0]}")
            out.update({f"layers.{i}.{p}": t for p, t in zip(params, parts, strict=True)})
    names = layer_names(LAYER_NAMES, TOP_NAMES, cfg.num_layers, src.format)
    out.update({p: src.require(names[p], p) for p in graph.params if p not in out})
    return out


def _attention_factor(factor: float, original: int) -> float:
    # transformers' (and llama.cpp's converter's) default for longrope
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def hf_longrope(hf: Mapping[str, Any], rope: RopeSpec, max_positions: int) -> RopeSpec:
    """transformers 5.24's Phi3Config: "su" and "yarn" mean longrope; the top-level original_max_position_embeddings
    (default 4096) wins over one inside rope_parameters; factor defaults to max / original positions, and the
    attention factor to sqrt(1 + ln(factor) / ln(original))."""
    p = dict(rope.scaling)
    if p.get("rope_type") not in ("su", "yarn", "longrope"):
        return rope
    original = int(hf.get("original_max_position_embeddings") or 4096)
    factor = p.get("factor") or max_positions / original
    attn = p.get("attention_factor") or _attention_factor(float(factor), original)
    return longrope(rope.theta, rope.rotary_dim, p["short_factor"], p["long_factor"], original, attn)


@dataclass(frozen=True)
class Phi3Config(ModelConfig):
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> Phi3Config:  # noqa: B006
        kw = hf_fields(hf, arch, defaults)
        return cls(**kw | {"rope": hf_longrope(hf, kw["rope"], kw["max_position_embeddings"])})

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors: tuple[float, ...] | None = None  # noqa: B006
                  ) -> Phi3Config:
        """llama.cpp writes longrope as rope_factors_long / _short tensors beside rope.scaling.attn_factor and
        rope.scaling.original_context_length (no rope.scaling.type); a sliding window of 0 means none (phi-4)."""
        kw = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        if "rope_factors_long.weight" in tensors:
            if not isinstance(tensors, WeightSource):
                raise ValueError("reading the longrope factors needs the file's tensors, not only their names")
            a = meta["general.architecture"]
            original = int(meta[f"{a}.rope.scaling.original_context_length"])
            attn = meta.get(f"{a}.rope.scaling.attn_factor")
            attn = _attention_factor(kw["max_position_embeddings"] / original, original) if attn is None else attn
            short, long = (tuple(tensors.require(f"rope_factors_{k}.weight").values().reshape(-1).tolist())
                           for k in ("short", "long"))
            kw["rope"] = longrope(kw["rope"].theta, kw["rope"].rotary_dim, short, long, original, attn)
        return cls(**kw)


ARCH = Architecture(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_archs=("phi3",),
    build=llama.build,
    load_weights=load_weights,
    config_cls=Phi3Config,
)
