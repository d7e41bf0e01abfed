"""The llama family: llama, llama3 rope scaling, mistral, yi, SmolLM. qwen2 and qwen3 reuse this
decoder with their flags (qkv bias, q/k norms)."""

from __future__ import annotations

from ir.config import ModelConfig
from ir.graph import Graph, Value
from ir.models import Architecture
from ir.models._decoder import embed, logits, output_name, step_inputs
from ir.models._names import bind, layer_names, unpermute_qk
from ir.rope import long_after
from ir.weights import WeightSource

# IR parameter -> (HF name, GGUF name); "{i}" is the layer index.
LAYER_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    "bo": ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias"),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    "b_gate": ("model.layers.{i}.mlp.gate_proj.bias", "blk.{i}.ffn_gate.bias"),
    "b_up": ("model.layers.{i}.mlp.up_proj.bias", "blk.{i}.ffn_up.bias"),
    "b_down": ("model.layers.{i}.mlp.down_proj.bias", "blk.{i}.ffn_down.bias"),
}
TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}


def load_weights(cfg: ModelConfig, graph: Graph, src: WeightSource, permuted_qk: bool = True) -> dict:
    """One tensor per parameter by name; GGUF q/k rows un-permuted where llama.cpp permuted them."""
    w = bind(graph, src, layer_names(LAYER_NAMES, TOP_NAMES, cfg.num_layers, src.format))
    if src.format == "gguf" and permuted_qk:
        unpermute_qk(w, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    return w


def load_weights_unpermuted(cfg: ModelConfig, graph: Graph, src: WeightSource) -> dict:
    """As load_weights, for the archs llama.cpp converts without permuting q/k (qwen2, qwen3)."""
    return load_weights(cfg, graph, src, permuted_qk=False)


def dense(g: Graph, x: Value, prefix: str, out: int, inp: int, bias: bool, shard: str,
           w: str, b: str) -> Value:
    weight = g.param(f"{prefix}.{w}", (out, inp), shard=shard)
    # A row-split layer's bias is added once, after the reduction: it is not sharded.
    bias_v = g.param(f"{prefix}.{b}", (out,), shard="column" if shard == "column" else None) if bias else None
    return g.linear(x, weight, bias_v)


def attention_block(g: Graph, cfg: ModelConfig, x: Value, i: int, pos: Value,
                     meta: list[Value], scale: float | None = None) -> Value:
    """q/k/v, optional q/k norms, rope, paged attention (scale: head_dim ** -0.5 unless the arch says), o."""
    p, d = f"layers.{i}", cfg.head_dim
    hq, hkv, h = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    q = dense(g, x, p, hq * d, h, cfg.qkv_bias, "column", "wq", "bq")
    k = dense(g, x, p, hkv * d, h, cfg.qkv_bias, "column", "wk", "bk")
    v = dense(g, x, p, hkv * d, h, cfg.qkv_bias, "column", "wv", "bv")
    q = g.reshape(q, shape=("T", hq, d))
    k = g.reshape(k, shape=("T", hkv, d))
    v = g.reshape(v, shape=("T", hkv, d))
    if cfg.qk_norm:
        q = g.rms_norm(q, g.param(f"{p}.q_norm", (d,)), eps=cfg.rms_norm_eps)
        k = g.rms_norm(k, g.param(f"{p}.k_norm", (d,)), eps=cfg.rms_norm_eps)
    seq = meta[2:] if long_after(cfg.rope) is not None else ()  # longrope: context_lens, query_start pick its table
    q = g.rope(q, pos, *seq, spec=cfg.rope)
    k = g.rope(k, pos, *seq, spec=cfg.rope)
    o = g.attention(q, k, v, *meta, layer=i, scale=d**-0.5 if scale is None else scale,
                    sliding_window=cfg.window_for(i))
    o = g.reshape(o, shape=("T", hq * d))
    return dense(g, o, p, h, hq * d, cfg.o_bias, "row", "wo", "bo")


def mlp_block(g: Graph, cfg: ModelConfig, x: Value, i: int,
              names: tuple[str, str, str] = ("w_gate", "w_up", "w_down")) -> Value:
    """act(gate x) * up x, then down; `names` of its three weights (a MoE layer's shared expert has its own)."""
    p, h, f = f"layers.{i}", cfg.hidden_size, cfg.intermediate_size
    wg, wu, wd = names
    gate = dense(g, x, p, f, h, cfg.mlp_bias, "column", wg, wg.replace("w_", "b_", 1))
    up = dense(g, x, p, f, h, cfg.mlp_bias, "column", wu, wu.replace("w_", "b_", 1))
    act = g.op(cfg.hidden_act, gate)
    return dense(g, g.mul(act, up), p, h, f, cfg.mlp_bias, "row", wd, wd.replace("w_", "b_", 1))


def prenorm_decoder(cfg: ModelConfig, dtype: str, attention=None, mlp=None) -> Graph:
    """One forward step of a pre-norm decoder over a flat varlen batch (logits for `logits_indices`): each layer
    h += attention(norm(h)), h += mlp(norm(h)). `attention(g, cfg, x, i, step_inputs)` and `mlp(g, cfg, x, i)`
    default to llama's; a MoE or latent-attention decoder passes its own."""
    attention = attention or (lambda g, c, x, i, s: attention_block(g, c, x, i, s.positions, s.attention))
    mlp = mlp or mlp_block
    g = Graph(cfg.arch, dtype)
    s = step_inputs(g)
    h, table = embed(g, cfg, s.ids)
    for i in range(cfg.num_layers):
        x = g.rms_norm(h, g.param(f"layers.{i}.attn_norm", (cfg.hidden_size,)), eps=cfg.rms_norm_eps)
        h = g.add(h, attention(g, cfg, x, i, s))
        x = g.rms_norm(h, g.param(f"layers.{i}.ffn_norm", (cfg.hidden_size,)), eps=cfg.rms_norm_eps)
        h = g.add(h, mlp(g, cfg, x, i))
    h = g.rms_norm(h, g.param("final_norm", (cfg.hidden_size,)), eps=cfg.rms_norm_eps)
    g.output(output_name(cfg), logits(g, cfg, h, table, s.logits_rows))
    return g


def build(cfg: ModelConfig, dtype: str = "f32") -> Graph:
    return prenorm_decoder(cfg, dtype)


ARCH = Architecture(
    name="llama",
    hf_model_types=("llama", "mistral", "yi"),
    gguf_archs=("llama", "mistral"),
    build=build,
    load_weights=load_weights,
)
