"""gemma, gemma2 and gemma3 (text): the llama decoder with Gemma's changes.

- gemma: RMS norms by (1 + w), the embedding scaled by sqrt(hidden), gelu_tanh, a tied head.
- gemma2: sandwich norms (after attention, before and after the feed-forward), attention and final logit
  softcapping, sliding-window and global layers alternating, the attention scale query_pre_attn_scalar ** -0.5.
- gemma3: no attention softcap, (1 + w) q/k norms, five sliding layers to one global by default, and a rope of its
  own for the sliding layers (theta 10000, unscaled); the global layers' rope may be scaled.

Norm weights: the graph multiplies by (1 + w) (rms_norm offset 1), as transformers stores them. llama.cpp's
converter stores 1 + w instead, so a GGUF file's norms get 1 subtracted here: one graph for both sources, and the
small w (not 1 + w) is what a bf16 backend rounds. llama.cpp does not permute gemma's q/k rows.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ir.config import _ACTS, ModelConfig, gguf_fields, hf_fields, hf_rope
from ir.graph import Graph, Value
from ir.models import Architecture
from ir.models._decoder import embed, step_inputs
from ir.models._decoder import logits as head_logits
from ir.models._names import bind, layer_names
from ir.rope import RopeSpec
from ir.weights import WeightSource

SLIDING, FULL = "sliding_attention", "full_attention"
LOCAL_THETA = 10000.0  # gemma3's sliding layers (transformers' default; llama.cpp fixes it)
# llama.cpp derives the attention scale from the model size: the 27B models (46 layers of gemma2, 62 of gemma3)
# use query_pre_attn_scalar = hidden / heads, the others head_dim. GGUF metadata has no key for it.
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    query_pre_attn_scalar: float | None = None  # the attention scale is this ** -0.5 (None: head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sandwich_norms: bool = False  # gemma2/3: norms after attention and before/after the feed-forward
    local_rope: RopeSpec | None = None  # gemma3: the sliding layers' rope (`rope` is the global layers')

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for(self, layer: int) -> RopeSpec:
        sliding = self.layer_types is not None and self.layer_types[layer] == SLIDING
        return self.local_rope if sliding and self.local_rope is not None else self.rope

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> GemmaConfig:  # noqa: B006
        for key in ("attention_bias", "use_bidirectional_attention"):
            if hf.get(key):
                raise ValueError(f"{key}=true is not supported for {arch}")
        kw = hf_fields(hf, arch, defaults)
        kw["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
        if arch == "gemma":
            # transformers reads hidden_act and takes a plain "gelu" (older gemma files) as the tanh approximation.
            act = hf.get("hidden_act") or "gelu_pytorch_tanh"
            kw["hidden_act"] = "gelu_tanh" if act == "gelu" else _act(act)
            return cls(**kw)
        kw["hidden_act"] = _act(hf.get("hidden_activation") or "gelu_pytorch_tanh")
        n, window = kw["num_layers"], hf.get("sliding_window", 4096)
        pattern = 2 if arch == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
        kw.update(
            sliding_window=int(window) if window else None,
            layer_types=tuple(hf.get("layer_types") or _pattern(n, pattern)),
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            attn_softcap=_cap(hf.get("attn_logit_softcapping", 50.0 if arch == "gemma2" else None)),
            final_softcap=_cap(hf.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)),
        )
        if arch == "gemma3":
            kw["rope"], kw["local_rope"] = _gemma3_hf_ropes(hf, kw["head_dim"])
        return cls(**kw)

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors: tuple[float, ...] | None = None  # noqa: B006
                  ) -> GemmaConfig:
        """llama.cpp's reading: gemma2's window defaults to 4096 and its softcaps to 50 / 30; the layer patterns
        (2 and 6) and gemma3's local rope are fixed, not stored."""
        kw = gguf_fields(meta, tensors, arch, defaults, freq_factors)
        if arch == "gemma":
            return cls(**kw)
        a = meta["general.architecture"]

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{a}.{key}", default)

        n = kw["num_layers"]
        window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
        kw.update(
            sliding_window=int(window) if window else None,
            layer_types=_pattern(n, 2 if arch == "gemma2" else 6),
            final_softcap=_cap(get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)),
        )
        if arch == "gemma2":
            kw["attn_softcap"] = _cap(get("attn_logit_softcapping", 50.0))
        elif window:  # llama.cpp: a gemma3 file without a window has global layers only, on the global rope
            kw["local_rope"] = RopeSpec(theta=LOCAL_THETA, rotary_dim=kw["rope"].rotary_dim)
        if n == GGUF_27B_LAYERS[arch]:
            kw["query_pre_attn_scalar"] = float(kw["hidden_size"] // kw["num_heads"])
        return cls(**kw)


def _act(name: str) -> str:
    if name not in _ACTS:
        raise ValueError(f"unsupported hidden activation {name!r}")
    return _ACTS[name]


def _cap(v: Any) -> float | None:
    return float(v) if v else None


def _pattern(num_layers: int, every: int) -> tuple[str, ...]:
    """transformers' default layer types: every `every`-th layer global, the others sliding."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))


def _gemma3_hf_ropes(hf: Mapping[str, Any], head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(global, local) ropes: transformers 5 writes rope_parameters per layer type; older files have rope_theta and
    rope_scaling (global layers only) and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        glob = {"rope_parameters": params.get(FULL) or {"rope_theta": 1e6}}
        local = {"rope_parameters": params.get(SLIDING) or {"rope_theta": LOCAL_THETA}}
    else:
        glob = {"rope_theta": hf.get("rope_theta") or 1e6, "rope_scaling": hf.get("rope_scaling"),
                "rope_parameters": params}
        local = {"rope_theta": hf.get("rope_local_base_freq") or LOCAL_THETA}
    return hf_rope(glob, head_dim), hf_rope(local, head_dim)


def _embed_scale(hidden: int, dtype: str) -> float:
    """sqrt(hidden) rounded to the compute dtype: transformers casts the normalizer to the activations' dtype."""
    s = np.float32(hidden**0.5)
    if dtype == "f16":
        return float(np.float16(s))
    if dtype == "bf16":  # round to nearest even on the upper 16 bits
        bits = int(s.view(np.uint32))
        return float(np.uint32((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32))
    return float(s)


def _attention_block(g: Graph, cfg: GemmaConfig, x: Value, i: int, pos: Value, meta: list[Value]) -> Value:
    p, d = f"layers.{i}", cfg.head_dim
    hq, hkv, h = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    q = g.reshape(g.linear(x, g.param(f"{p}.wq", (hq * d, h), shard="column")), shape=("T", hq, d))
    k = g.reshape(g.linear(x, g.param(f"{p}.wk", (hkv * d, h), shard="column")), shape=("T", hkv, d))
    v = g.reshape(g.linear(x, g.param(f"{p}.wv", (hkv * d, h), shard="column")), shape=("T", hkv, d))
    if cfg.qk_norm:
        q = g.rms_norm(q, g.param(f"{p}.q_norm", (d,)), eps=cfg.rms_norm_eps, offset=1.0)
        k = g.rms_norm(k, g.param(f"{p}.k_norm", (d,)), eps=cfg.rms_norm_eps, offset=1.0)
    spec = cfg.rope_for(i)
    q, k = g.rope(q, pos, spec=spec), g.rope(k, pos, spec=spec)
    o = g.attention(q, k, v, *meta, layer=i, scale=cfg.attn_scale, sliding_window=cfg.window_for(i),
                    softcap=cfg.attn_softcap)
    return g.linear(g.reshape(o, shape=("T", hq * d)), g.param(f"{p}.wo", (h, hq * d), shard="row"))


def _mlp_block(g: Graph, cfg: GemmaConfig, x: Value, i: int) -> Value:
    p, h, f = f"layers.{i}", cfg.hidden_size, cfg.intermediate_size
    gate = g.linear(x, g.param(f"{p}.w_gate", (f, h), shard="column"))
    up = g.linear(x, g.param(f"{p}.w_up", (f, h), shard="column"))
    return g.linear(g.mul(g.op(cfg.hidden_act, gate), up), g.param(f"{p}.w_down", (h, f), shard="row"))


def build(cfg: GemmaConfig, dtype: str = "f32") -> Graph:
    """One forward step over a flat varlen batch; logits for `logits_indices`."""
    g = Graph(cfg.arch, dtype)
    s = step_inputs(g)
    pos, meta = s.positions, s.attention

    def norm(x: Value, name: str) -> Value:
        return g.rms_norm(x, g.param(name, (cfg.hidden_size,)), eps=cfg.rms_norm_eps, offset=1.0)

    h, table = embed(g, cfg, s.ids)
    h = g.scale(h, factor=_embed_scale(cfg.hidden_size, dtype))
    for i in range(cfg.num_layers):
        a = _attention_block(g, cfg, norm(h, f"layers.{i}.attn_norm"), i, pos, meta)
        h = g.add(h, norm(a, f"layers.{i}.post_attn_norm") if cfg.sandwich_norms else a)
        m = _mlp_block(g, cfg, norm(h, f"layers.{i}.ffn_norm"), i)
        h = g.add(h, norm(m, f"layers.{i}.post_ffn_norm") if cfg.sandwich_norms else m)
    logits = head_logits(g, cfg, norm(h, "final_norm"), table, s.logits_rows)
    g.output("logits", g.softcap(logits, cap=cfg.final_softcap) if cfg.final_softcap else logits)
    return g


# IR parameter -> (HF name, GGUF name); gemma (1) has the llama layout, gemma2/3 four norms a layer.
_COMMON = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
}
GEMMA_NAMES = {**_COMMON,
               "ffn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight")}
SANDWICH_NAMES = {
    **_COMMON,
    "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    "ffn_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "post_ffn_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
}
TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}


def load_weights(cfg: GemmaConfig, graph: Graph, src: WeightSource) -> dict:
    """One tensor per parameter by name; a GGUF file's norms hold llama.cpp's 1 + w, so 1 comes off."""
    table = SANDWICH_NAMES if cfg.sandwich_norms else GEMMA_NAMES
    w = bind(graph, src, layer_names(table, TOP_NAMES, cfg.num_layers, src.format))
    if src.format == "gguf":
        for name in {n.inputs[1].name for n in graph.nodes if n.op == "rms_norm"}:
            w[name] = w[name].dense_map(lambda x: x - np.float32(1.0))
    return w


def _arch(name: str, hf_type: str, **defaults: Any) -> Architecture:
    return Architecture(name=name, hf_model_types=(hf_type,), gguf_archs=(name,), build=build,
                        load_weights=load_weights, config_cls=GemmaConfig,
                        defaults={"hidden_act": "gelu_tanh", **defaults})


ARCHS = (
    _arch("gemma", "gemma"),
    _arch("gemma2", "gemma2", sandwich_norms=True),
    _arch("gemma3", "gemma3_text", sandwich_norms=True, qk_norm=True),
)
