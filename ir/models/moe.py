"""Sparse mixture-of-experts decoders on llama's attention: Mixtral, Qwen2-MoE (with its sigmoid-gated shared
expert), Qwen3-MoE (q/k norms). A MoE layer routes each token to its top_k experts (`moe_route`) and sums their
gated MLPs, weighted (`moe_experts` over [experts, out, in] stacks); layers listed dense (`mlp_only_layers`, or off
the `decoder_sparse_step`) keep llama's MLP.

HF checkpoints store one tensor per expert (stacked here at load; transformers 5's own fused `gate_up_proj` stacks
are split by rows); llama.cpp stores the stacks (`ffn_gate_exps`, ...), and converts Mixtral as "llama" with an
expert count, which is how the registry tells it from a dense llama file.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ir.config import ModelConfig, gguf_fields, hf_fields
from ir.graph import Graph, Value
from ir.models import Architecture, llama
from ir.models._names import layer_names, unpermute_qk
from ir.weights import StoredTensor, WeightSource, stack


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with llama's MLP instead of experts

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> MoEConfig:  # noqa: B006
        f = hf_fields(hf, arch, defaults)
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # transformers 5 writes the latter
        if arch == "mixtral":
            return cls(**f, num_experts=experts, top_k=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=f["intermediate_size"])
        step = int(hf.get("decoder_sparse_step") or 1)
        only = set(hf.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(f["num_layers"]) if i in only or (i + 1) % step)
        return cls(**f, num_experts=experts, top_k=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)), dense_layers=dense)

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors=None) -> MoEConfig:  # noqa: B006
        a = meta["general.architecture"]
        f = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        layers = f["num_layers"]
        dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensors)
        # llama.cpp renormalizes Mixtral's and Qwen3-MoE's weights, not Qwen2-MoE's, unless the file says.
        norm = meta.get(f"{a}.expert_weights_norm", arch != "qwen2_moe")
        return cls(**f, num_experts=int(meta[f"{a}.expert_count"]), top_k=int(meta[f"{a}.expert_used_count"]),
                   moe_intermediate_size=int(meta.get(f"{a}.expert_feed_forward_length") or f["intermediate_size"]),
                   shared_expert_intermediate_size=int(meta.get(f"{a}.expert_shared_feed_forward_length") or 0),
                   norm_topk_prob=bool(norm), dense_layers=dense)


def moe_block(g: Graph, cfg: MoEConfig, x: Value, i: int) -> Value:
    p, h, e, f = f"layers.{i}", cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    scores = g.linear(x, g.param(f"{p}.router", (e, h)))
    weights, ids = g.moe_route(scores, top_k=cfg.top_k, scoring="softmax", norm_topk_prob=cfg.norm_topk_prob)
    # Tensor parallel splits each expert (ir.sharding): its gate and up rows, its down columns.
    y = g.moe_experts(x, weights, ids, g.param(f"{p}.exp_gate", (e, f, h), shard="column"),
                      g.param(f"{p}.exp_up", (e, f, h), shard="column"),
                      g.param(f"{p}.exp_down", (e, h, f), shard="row"), act=cfg.hidden_act)
    if cfg.shared_expert_intermediate_size:
        shared = llama.mlp_block(g, replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), x, i,
                                 names=("sh_gate", "sh_up", "sh_down"))
        gate = g.sigmoid(g.linear(x, g.param(f"{p}.sh_router", (1, h))))
        y = g.add(y, g.mul(shared, gate))
    return y


def build(cfg: MoEConfig, dtype: str = "f32") -> Graph:
    def mlp(g, c, x, i):
        return moe_block(g, c, x, i) if c.is_moe(i) else llama.mlp_block(g, c, x, i)

    return llama.prenorm_decoder(cfg, dtype, mlp=mlp)


# IR parameter -> (HF name, GGUF name) of a MoE layer; HF experts per expert ("{e}"), GGUF as stacks.
MIXTRAL = {"router": "block_sparse_moe.gate.weight", "exp_gate": "block_sparse_moe.experts.{e}.w1.weight",
           "exp_up": "block_sparse_moe.experts.{e}.w3.weight", "exp_down": "block_sparse_moe.experts.{e}.w2.weight"}
QWEN = {"router": "mlp.gate.weight", "exp_gate": "mlp.experts.{e}.gate_proj.weight",
        "exp_up": "mlp.experts.{e}.up_proj.weight", "exp_down": "mlp.experts.{e}.down_proj.weight",
        "sh_gate": "mlp.shared_expert.gate_proj.weight", "sh_up": "mlp.shared_expert.up_proj.weight",
        "sh_down": "mlp.shared_expert.down_proj.weight", "sh_router": "mlp.shared_expert_gate.weight"}
GGUF = {"router": "ffn_gate_inp", "exp_gate": "ffn_gate_exps", "exp_up": "ffn_up_exps", "exp_down": "ffn_down_exps",
        "sh_gate": "ffn_gate_shexp", "sh_up": "ffn_up_shexp", "sh_down": "ffn_down_shexp",
        "sh_router": "ffn_gate_inp_shexp"}


def hf_experts(src: WeightSource, cfg: MoEConfig, i: int, key: str, name: str) -> StoredTensor:
    """One expert stack from per-expert tensors, or from transformers 5's fused stacks (gate_up_proj rows split)."""
    base = f"model.layers.{i}."
    per_expert = base + name.format(e=0)
    if per_expert in src:
        return stack([src.require(base + name.format(e=e), f"layers.{i}.{key}") for e in range(cfg.num_experts)])
    prefix = base + name.split(".experts.")[0] + ".experts."
    if key == "exp_down":
        return src.require(prefix + "down_proj", f"layers.{i}.{key}")
    fused = src.require(prefix + "gate_up_proj", f"layers.{i}.{key}")
    half = cfg.moe_intermediate_size
    return fused.rows_of_each(0 if key == "exp_gate" else half, half)


def load_weights(cfg: MoEConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    moe_names = MIXTRAL if cfg.arch == "mixtral" else QWEN
    out: dict[str, StoredTensor] = {}
    for p in graph.params:
        head, _, key = p.rpartition(".")
        layer = int(head.split(".")[1]) if head.startswith("layers.") else None
        if layer is None or key not in moe_names:
            continue
        if src.format == "gguf":
            t = src.require(f"blk.{layer}.{GGUF[key]}.weight", p)
            out[p] = t.reshaped(graph.params[p].shape) if key == "sh_router" else t  # GGUF's is [hidden]
        elif "{e}" in moe_names[key]:
            out[p] = hf_experts(src, cfg, layer, key, moe_names[key])
        else:
            out[p] = src.require(f"model.layers.{layer}.{moe_names[key]}", p)
    names = layer_names(llama.LAYER_NAMES, llama.TOP_NAMES, cfg.num_layers, src.format)
    w = {p: out[p] if p in out else src.require(names.get(p, p), p) for p in graph.params}
    if src.format == "gguf" and cfg.arch == "mixtral":  # converted as llama: q/k rows permuted
        unpermute_qk(w, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    return w


def _has_experts(meta: Mapping[str, Any]) -> bool:
    return int(meta.get(f"{meta['general.architecture']}.expert_count") or 0) > 0


ARCHS = (
    Architecture(name="mixtral", hf_model_types=("mixtral",), gguf_archs=("llama",), build=build,
                 load_weights=load_weights, config_cls=MoEConfig, gguf_match=_has_experts),
    Architecture(name="qwen2_moe", hf_model_types=("qwen2_moe",), gguf_archs=("qwen2moe",), build=build,
                 load_weights=load_weights, config_cls=MoEConfig, defaults={"qkv_bias": True}),
    Architecture(name="qwen3_moe", hf_model_types=("qwen3_moe",), gguf_archs=("qwen3moe",), build=build,
                 load_weights=load_weights, config_cls=MoEConfig, defaults={"qk_norm": True}),
)
