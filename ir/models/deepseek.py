"""DeepSeek-V2 / V3 (and the R1 family, which is V3): multi-head latent attention and routed experts with shared
ones.

Attention (MLA): q through a low-rank pair with an RMSNorm between (q_lora_rank; V2-Lite projects it directly);
keys and values from a compressed latent (kv_lora_rank, RMS-normed) plus one rope key shared by every head
(qk_rope_head_dim, interleaved pairs). The paged cache holds only [latent | rope key] per token and layer
(`latent_attention`), and attention runs in the absorbed form, prefill and decode alike: kv_b_proj's per-head
K-nope rows (W_UK) are folded into the query, q_nope @ W_UK giving a kv_lora_rank-wide query per head that meets
the latent directly, so a score is q_absorbed . latent + q_rope . k_rope, the same sum the expanded form computes;
each head's output is its softmax over the latents, through that head's V rows (W_UV), then o_proj. The softmax
scale is qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared when the rope is scaled.

Experts: layers from first_k_dense_replace on (every moe_layer_freq-th) are MoE: V2 routes by softmax, greedily or
within the best topk_group of n_group groups (a group scores its best expert); V3 by sigmoid plus a correction bias
for the choice, groups scored by their best two; weights times routed_scaling_factor; n_shared_experts always run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from math import log
from typing import Any

import numpy as np

from ir.config import ModelConfig, hf_fields, hf_rope
from ir.graph import Graph, Value
from ir.models import Architecture, llama
from ir.models._names import layer_names
from ir.models.moe import QWEN as MOE_NAMES
from ir.models.moe import hf_experts
from ir.weights import StoredTensor, WeightSource


@dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    q_lora_rank: int = 0  # 0: q projected directly
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attn_scale: float = 1.0
    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    norm_topk_prob: bool = False
    routed_scaling: float = 1.0
    score_bias: bool = False  # V3's e_score_correction_bias

    # The shared experts' width: all of them as one MLP (transformers builds them so).
    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> DeepseekConfig:  # noqa: B006
        rope_dim, nope = int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
        f = hf_fields({**hf, "head_dim": nope + rope_dim}, arch, defaults)
        interleave = arch == "deepseek_v2" or bool(hf.get("rope_interleave", True))
        rope = replace(hf_rope({**hf, "head_dim": rope_dim}, rope_dim), style="interleaved" if interleave else "neox")
        scale = (nope + rope_dim) ** -0.5
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
            factor = float(params["factor"])
            m = 0.1 * float(params["mscale_all_dim"]) * log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        layers, first = f["num_layers"], int(hf.get("first_k_dense_replace") or 0)
        freq = int(hf.get("moe_layer_freq") or 1)
        experts = int(hf.get("n_routed_experts") or 0)
        v3 = arch == "deepseek_v3"
        method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        groups = int(hf.get("n_group") or 1) if method in ("group_limited_greedy", "noaux_tc") else 1
        return cls(**f | dict(rope=rope), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                   kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                   v_head_dim=int(hf["v_head_dim"]), attn_scale=scale, num_experts=experts,
                   top_k=int(hf.get("num_experts_per_tok") or 1),
                   moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
                   n_shared_experts=int(hf.get("n_shared_experts") or 0),
                   dense_layers=tuple(i for i in range(layers) if not experts or i < first or i % freq),
                   scoring=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"), n_group=groups,
                   topk_group=int(hf.get("topk_group") or 1) if groups > 1 else 1,
                   group_score="top2_sum" if method == "noaux_tc" else "max",
                   norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
                   routed_scaling=float(hf.get("routed_scaling_factor") or 1.0), score_bias=method == "noaux_tc")


def mla_block(g: Graph, cfg: DeepseekConfig, x: Value, i: int, pos: Value, meta: list[Value]) -> Value:
    p, h, heads = f"layers.{i}", cfg.hidden_size, cfg.num_heads
    nope, rope, vd, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qk = nope + rope
    if cfg.q_lora_rank:
        qa = g.linear(x, g.param(f"{p}.q_a", (cfg.q_lora_rank, h), shard=None))
        qa = g.rms_norm(qa, g.param(f"{p}.q_a_norm", (cfg.q_lora_rank,)), eps=cfg.rms_norm_eps)
        q = g.linear(qa, g.param(f"{p}.q_b", (heads * qk, cfg.q_lora_rank), shard="column"))
    else:
        q = g.linear(x, g.param(f"{p}.wq", (heads * qk, h), shard="column"))
    q = g.reshape(q, shape=("T", heads, qk))  # each head [nope | rope], as HF lays it out
    kv_a = g.linear(x, g.param(f"{p}.kv_a", (rank + rope, h)))
    latent = g.rms_norm(g.slice(kv_a, start=0, size=rank), g.param(f"{p}.kv_a_norm", (rank,)), eps=cfg.rms_norm_eps)
    q_rot = g.rope(g.slice(q, start=nope, size=rope), pos, spec=cfg.rope)
    k_rot = g.rope(g.reshape(g.slice(kv_a, start=rank, size=rope), shape=("T", 1, rope)), pos, spec=cfg.rope)
    # The latent first: a value is the leading value_dim of what is cached.
    q_lat = g.head_linear(g.slice(q, start=0, size=nope), g.param(f"{p}.w_uk", (heads, rank, nope), shard="heads"))
    o = g.latent_attention(g.concat(q_lat, q_rot), g.concat(g.reshape(latent, shape=("T", 1, rank)), k_rot), *meta,
                           layer=i, scale=cfg.attn_scale, value_dim=rank)
    o = g.head_linear(o, g.param(f"{p}.w_uv", (heads, vd, rank), shard="heads"))
    o = g.reshape(o, shape=("T", heads * vd))
    return g.linear(o, g.param(f"{p}.wo", (h, heads * vd), shard="row"))


def moe_block(g: Graph, cfg: DeepseekConfig, x: Value, i: int) -> Value:
    p, h, e, f = f"layers.{i}", cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    scores = g.linear(x, g.param(f"{p}.router", (e, h)))
    bias = g.param(f"{p}.router_bias", (e,)) if cfg.score_bias else None
    weights, ids = g.moe_route(scores, bias, top_k=cfg.top_k, scoring=cfg.scoring, norm_topk_prob=cfg.norm_topk_prob,
                               routed_scaling=cfg.routed_scaling, n_group=cfg.n_group, topk_group=cfg.topk_group,
                               group_score=cfg.group_score)
    y = g.moe_experts(x, weights, ids, g.param(f"{p}.exp_gate", (e, f, h)), g.param(f"{p}.exp_up", (e, f, h)),
                      g.param(f"{p}.exp_down", (e, h, f)), act=cfg.hidden_act)
    if cfg.n_shared_experts:
        shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
        y = g.add(y, llama.mlp_block(g, shared, x, i, names=("sh_gate", "sh_up", "sh_down")))
    return y


def build(cfg: DeepseekConfig, dtype: str = "f32") -> Graph:
    def mlp(g, c, x, i):
        return llama.mlp_block(g, c, x, i) if i in c.dense_layers else moe_block(g, c, x, i)

    return llama.prenorm_decoder(cfg, dtype, lambda g, c, x, i, s: mla_block(g, c, x, i, s.positions, s.attention),
                                 mlp)


HF_NAMES = {
    "q_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b": "self_attn.q_b_proj.weight", "wq": "self_attn.q_proj.weight",
    "kv_a": "self_attn.kv_a_proj_with_mqa.weight", "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "w_uk": "self_attn.kv_b_proj.weight", "w_uv": "self_attn.kv_b_proj.weight", "wo": "self_attn.o_proj.weight",
    "router_bias": "mlp.gate.e_score_correction_bias",
    **{k: v.replace("shared_expert.", "shared_experts.") for k, v in MOE_NAMES.items() if k != "sh_router"},
}


def load_weights(cfg: DeepseekConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    if src.format != "hf":
        raise ValueError("DeepSeek GGUF files (llama.cpp's deepseek2) are not read yet: their MLA tensors are split "
                         "differently (attn_kv_b or attn_k_b / attn_v_b)")
    names = layer_names(llama.LAYER_NAMES, llama.TOP_NAMES, cfg.num_layers, "hf")
    out = {}
    for p in graph.params:
        head, _, key = p.rpartition(".")
        if head.startswith("layers.") and key in HF_NAMES:
            i = int(head.split(".")[1])
            name = HF_NAMES[key]
            if "{e}" in name:
                out[p] = hf_experts(src, cfg, i, key, name)
            else:
                t = src.require(f"model.{head}.{name}", p)
                out[p] = absorbed(cfg, t, key) if key in ("w_uk", "w_uv") else t
        else:
            out[p] = src.require(names.get(p, p), p)
    return out


def absorbed(cfg: DeepseekConfig, kv_b: StoredTensor, key: str) -> StoredTensor:
    """W_UK ("w_uk": [heads, rank, nope], transposed so that head_linear reads it as [out, in]) or W_UV ("w_uv":
    [heads, v_head_dim, rank]) out of kv_b_proj [heads * (nope + v_head_dim), rank], whose rows per head are the K-nope
    part, then V. Elements are moved as stored (bf16 stays bf16)."""
    heads, nope, vd, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if kv_b.quantized or kv_b.data.size != heads * (nope + vd) * rank:
        raise ValueError(f"{kv_b.source}: a dense [{heads * (nope + vd)}, {rank}] kv_b_proj is needed to split out "
                         f"W_UK and W_UV, not {kv_b.kind} {list(kv_b.shape)}")
    w = kv_b.data.reshape(heads, nope + vd, rank)
    part = w[:, :nope].transpose(0, 2, 1) if key == "w_uk" else w[:, nope:]
    data = np.ascontiguousarray(part)
    return StoredTensor(data, kv_b.kind, data.shape, f"{kv_b.source} ({'W_UK^T' if key == 'w_uk' else 'W_UV'})")


ARCHS = tuple(
    Architecture(name=name, hf_model_types=(name,), gguf_archs=(), build=build, load_weights=load_weights,
                 config_cls=DeepseekConfig)
    for name in ("deepseek_v2", "deepseek_v3"))
