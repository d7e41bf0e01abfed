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

GGUF: llama.cpp writes both as "deepseek2" (V3 told by its sigmoid gating), in HF's row order (no q/k permutation:
its rope for deepseek2 is the interleaved one the checkpoints use). Older files keep kv_b_proj as attn_kv_b and give
key/value_length as the heads' widths; newer ones store it split per head, attn_k_b (W_UK^T, [heads, rank, nope]) and
attn_v_b ([heads, v_head_dim, rank]), with key/value_length the latent's (rank + rope, rank) and the heads' widths
under the _mla keys.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from math import log
from typing import Any

import numpy as np

from ir.config import ModelConfig, gguf_fields, hf_fields, hf_rope
from ir.graph import Graph, Value
from ir.models import Architecture, llama
from ir.models._names import layer_names
from ir.models.moe import GGUF as MOE_GGUF
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
        scale = softmax_scale(nope + rope_dim, hf.get("rope_parameters") or hf.get("rope_scaling") or {})
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

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors=None) -> DeepseekConfig:  # noqa: B006
        a = meta["general.architecture"]

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{a}.{key}", default)

        f = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        # block_count counts multi-token-prediction blocks (GLM's files keep them after the decoder): not ours
        f["num_layers"] -= int(get("nextn_predict_layers") or 0)
        heads, rope_dim, rank = f["num_heads"], int(get("rope.dimension_count")), int(get("attention.kv_lora_rank"))
        if get("attention.key_length_mla") is not None:  # newer files: key/value_length are the latent's
            qk, vd = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
        else:
            qk = int(get("attention.key_length") or f["hidden_size"] // heads)
            vd = int(get("attention.value_length") or qk)
        params = dict(f["rope"].scaling)
        if params.get("rope_type") == "yarn":
            params.update({k: float(get(f"rope.scaling.yarn_{k}")) for k in ("beta_fast", "beta_slow")
                           if get(f"rope.scaling.yarn_{k}") is not None})
            # The converter writes 0.1 * mscale_all_dim; llama.cpp takes mscale equal to it for deepseek2 (1 for
            # V3, 0.707 both for V2), so cos/sin stay unscaled and the softmax takes mscale squared, as here.
            if get("rope.scaling.yarn_log_multiplier"):
                m = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
                params.update(mscale=m, mscale_all_dim=m)
        rope = replace(f["rope"], style="interleaved", scaling=tuple(sorted(params.items())))
        layers, experts = f["num_layers"], int(get("expert_count") or 0)
        first = int(get("leading_dense_block_count") or 0)
        dense = tuple(i for i in range(layers)
                      if not experts or i < first or f"blk.{i}.ffn_gate_inp.weight" not in tensors)
        gating = int(get("expert_gating_func") or 1)  # absent in V2 files: softmax, as llama.cpp reads them
        if gating not in (1, 2):
            raise ValueError(f"expert_gating_func {gating}: only 1 (softmax) and 2 (sigmoid) are DeepSeek's")
        bias = any(f"blk.{i}.exp_probs_b.bias" in tensors for i in range(layers))
        groups = int(get("expert_group_count") or 1)
        width = get("expert_feed_forward_length") or 0  # llama.cpp also takes one a layer
        widths = {int(width[i]) for i in range(layers) if i not in dense} if isinstance(width, list) else {int(width)}
        if len(widths) > 1:
            raise ValueError(f"expert widths differ between layers ({sorted(widths)}): one is supported")
        return cls(**f | dict(rope=rope, head_dim=qk, num_kv_heads=heads),  # GGUF's 1 KV head is the latent's view
                   q_lora_rank=int(get("attention.q_lora_rank") or 0) if "blk.0.attn_q_a.weight" in tensors else 0,
                   kv_lora_rank=rank, qk_nope_head_dim=qk - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=vd,
                   attn_scale=softmax_scale(qk, params), num_experts=experts, top_k=int(get("expert_used_count") or 1),
                   moe_intermediate_size=widths.pop() if widths else 0,
                   n_shared_experts=int(get("expert_shared_count") or 0), dense_layers=dense,
                   scoring="sigmoid" if gating == 2 else "softmax", n_group=groups,
                   topk_group=int(get("expert_group_used_count") or 1) if groups > 1 else 1,
                   # The file does not say topk_method. transformers scores a group by its best two experts for
                   # V3 (noaux_tc: sigmoid and the bias), by its best one for V2 (group_limited_greedy); llama.cpp
                   # sums the best two for every file, so a grouped V2 file follows the model here, not llama.cpp.
                   group_score="top2_sum" if bias or gating == 2 else "max",
                   norm_topk_prob=bool(get("expert_weights_norm", False)),
                   routed_scaling=float(get("expert_weights_scale") or 1.0), score_bias=bias)


def softmax_scale(qk_head_dim: int, rope_params: Mapping[str, Any]) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared when the rope is scaled."""
    scale = qk_head_dim ** -0.5
    p = rope_params
    if p.get("rope_type", p.get("type", "default")) != "default" and p.get("mscale_all_dim"):
        factor = float(p["factor"])
        m = 0.1 * float(p["mscale_all_dim"]) * log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


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
    # Tensor parallel splits each expert (ir.sharding): its gate and up rows, its down columns.
    y = g.moe_experts(x, weights, ids, g.param(f"{p}.exp_gate", (e, f, h), shard="column"),
                      g.param(f"{p}.exp_up", (e, f, h), shard="column"),
                      g.param(f"{p}.exp_down", (e, h, f), shard="row"), act=cfg.hidden_act)
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


# IR parameter of layer i -> llama.cpp's tensor blk.{i}.<name> (attn_norm, ffn_norm and a dense layer's MLP are
# llama's); W_UK / W_UV come from attn_k_b / attn_v_b, or out of an older file's attn_kv_b.
GGUF_NAMES = {
    "q_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "q_b": "attn_q_b.weight", "wq": "attn_q.weight",
    "kv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "wo": "attn_output.weight",
    "w_uk": "attn_k_b.weight", "w_uv": "attn_v_b.weight", "router_bias": "exp_probs_b.bias",
    **{k: f"{v}.weight" for k, v in MOE_GGUF.items() if k != "sh_router"},
}


def load_weights(cfg: DeepseekConfig, graph: Graph, src: WeightSource) -> dict[str, StoredTensor]:
    names = layer_names(llama.LAYER_NAMES, llama.TOP_NAMES, cfg.num_layers, src.format)
    table = HF_NAMES if src.format == "hf" else GGUF_NAMES
    out = {}
    for p in graph.params:
        head, _, key = p.rpartition(".")
        if not (head.startswith("layers.") and key in table):
            out[p] = src.require(names.get(p, p), p)
            continue
        i = int(head.split(".")[1])
        if src.format == "gguf":
            out[p] = gguf_tensor(cfg, src, i, key, p)
        elif "{e}" in HF_NAMES[key]:
            out[p] = hf_experts(src, cfg, i, key, HF_NAMES[key])
        else:
            t = src.require(f"model.{head}.{HF_NAMES[key]}", p)
            out[p] = absorbed(cfg, t, key) if key in ("w_uk", "w_uv") else t
    return out


def gguf_tensor(cfg: DeepseekConfig, src: WeightSource, i: int, key: str, param: str) -> StoredTensor:
    blk = f"blk.{i}."
    name = blk + GGUF_NAMES[key]
    if key in ("w_uk", "w_uv"):
        # head_linear takes dense weights, and these are small (both 17M values a layer at V3's sizes): a quantized
        # file's are decoded to F32 here, through their weight format.
        if name in src:  # already per head, in the IR's layout: [heads, rank, nope] and [heads, v_head_dim, rank]
            return src.require(name, param).as_elements()
        return absorbed(cfg, src.require(blk + "attn_kv_b.weight", param), key)
    if key in ("exp_gate", "exp_up") and name not in src and blk + "ffn_gate_up_exps.weight" in src:
        fused = src.require(blk + "ffn_gate_up_exps.weight", param)  # [experts, gate rows | up rows, hidden]
        width = cfg.moe_intermediate_size
        return fused.rows_of_each(0 if key == "exp_gate" else width, width)
    return src.require(name, param)


def absorbed(cfg: DeepseekConfig, kv_b: StoredTensor, key: str) -> StoredTensor:
    """W_UK ("w_uk": [heads, rank, nope], transposed so that head_linear reads it as [out, in]) or W_UV ("w_uv":
    [heads, v_head_dim, rank]) out of kv_b_proj [heads * (nope + v_head_dim), rank], whose rows per head are the K-nope
    part, then V. Dense elements are moved as stored (bf16 stays bf16); quantized blocks are decoded to F32 first."""
    heads, nope, vd, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if tuple(kv_b.shape) != (heads * (nope + vd), rank):
        raise ValueError(f"{kv_b.source}: a [{heads * (nope + vd)}, {rank}] kv_b_proj is needed to split out "
                         f"W_UK and W_UV, not {kv_b.kind} {list(kv_b.shape)}")
    kv_b = kv_b.as_elements()
    w = kv_b.data.reshape(heads, nope + vd, rank)
    part = w[:, :nope].transpose(0, 2, 1) if key == "w_uk" else w[:, nope:]
    data = np.ascontiguousarray(part)
    return StoredTensor(data, kv_b.kind, data.shape, f"{kv_b.source} ({'W_UK^T' if key == 'w_uk' else 'W_UV'})")


def _sigmoid_gated(meta: Mapping[str, Any]) -> bool:
    return int(meta.get(f"{meta['general.architecture']}.expert_gating_func") or 1) == 2


# llama.cpp's "deepseek2" holds both; a file with sigmoid gating is V3's (the registry tries a match first).
ARCHS = tuple(
    Architecture(name=name, hf_model_types=(name,), gguf_archs=("deepseek2",), build=build, load_weights=load_weights,
                 config_cls=DeepseekConfig, gguf_match=_sigmoid_gated if name == "deepseek_v3" else None)
    for name in ("deepseek_v2", "deepseek_v3"))
