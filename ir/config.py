"""Model hyper-parameters, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ir.rope import RopeSpec


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the registry's architecture name
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Which layers the window applies to ("sliding_attention" / "full_attention"); None means all.
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    source_model_type: str = ""
    # An embedding model's graph (ir.pooling): it ends at the final norm, its output "hidden" instead of "logits".
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in ("silu", "gelu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {self.hidden_act!r}")

    def window_for(self, layer: int) -> int | None:
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def with_(self, **kw: Any) -> ModelConfig:
        return replace(self, **kw)

    # An architecture with hyper-parameters of its own subclasses this and extends the two readers below
    # (super()'s fields plus its own); the generic parsers know only what every decoder has.
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], arch: str, defaults: Mapping[str, Any] = {}) -> ModelConfig:  # noqa: B006
        """From an HF config.json (its parsed dict)."""
        return cls(**hf_fields(hf, arch, defaults))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensors: Collection[str], arch: str,
                  defaults: Mapping[str, Any] = {}, freq_factors: tuple[float, ...] | None = None  # noqa: B006
                  ) -> ModelConfig:
        """From GGUF metadata and the names of the file's tensors (what is present describes biases, norms, ties)."""
        return cls(**gguf_fields(meta, tensors, arch, defaults, freq_factors))


_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
         "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, list | tuple) else (int(v),)


def hf_rope(cfg: Mapping[str, Any], head_dim: int) -> RopeSpec:
    """transformers 5 keeps theta and scaling in `rope_parameters`; older files use `rope_theta` and
    `rope_scaling`. Read both, so that neither layout silently falls back to a default theta."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if v is not None})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    partial = float(params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    # Lists (longrope's factors, an mrope_section) become tuples: a RopeSpec is hashed (attrs, graph caches).
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    scaling = () if kind == "default" else tuple(sorted({"rope_type": kind, **params}.items()))
    return RopeSpec(theta=float(theta), rotary_dim=int(head_dim * partial), scaling=scaling)


def hf_fields(cfg: Mapping[str, Any], arch: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The common fields, from an HF config.json; ModelConfig.from_hf and the architectures' own config classes
    start from these."""
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    layer_types = cfg.get("layer_types")
    if window and not layer_types and cfg.get("max_window_layers") is not None:
        # qwen2/qwen3 before transformers 5 wrote layer_types: layers from max_window_layers on slide.
        n = int(cfg["num_hidden_layers"])
        layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention" for i in range(n)]
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if act not in _ACTS:
        raise ValueError(f"unsupported hidden_act {act!r}")
    kw = dict(defaults)
    for key in ("qkv_bias", "o_bias"):
        if "attention_bias" in cfg:
            kw[key] = bool(cfg["attention_bias"])
    if "mlp_bias" in cfg:
        kw["mlp_bias"] = bool(cfg["mlp_bias"])
    return dict(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=hf_rope(cfg, head_dim),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=_ACTS[act],
        sliding_window=int(window) if window else None,
        layer_types=tuple(layer_types) if window and layer_types else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        source_model_type=str(cfg.get("model_type", "")),
    ) | kw


# GGUF metadata has no bias or norm flags: the tensors present are the description (llama.cpp's names).
GGUF_OPTIONAL = {"qkv_bias": "blk.0.attn_q.bias", "o_bias": "blk.0.attn_output.bias",
                 "mlp_bias": "blk.0.ffn_up.bias", "qk_norm": "blk.0.attn_q_norm.weight"}


def gguf_fields(meta: Mapping[str, Any], tensors: Collection[str], arch: str, defaults: Mapping[str, Any],
                freq_factors: tuple[float, ...] | None = None) -> dict[str, Any]:
    """The common fields, from GGUF metadata and the names of the file's tensors."""
    a = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{a}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    kind = get("rope.scaling.type") or "default"
    scaling: dict[str, Any] = {}
    if kind not in ("none", "default"):
        scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    rope = RopeSpec(theta=float(get("rope.freq_base", 10000.0)),
                    rotary_dim=int(get("rope.dimension_count") or head_dim),
                    scaling=tuple(sorted(scaling.items())), freq_factors=freq_factors)
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    window = get("attention.sliding_window")
    present = {flag: True for flag, name in GGUF_OPTIONAL.items() if name in tensors}
    return dict(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        max_position_embeddings=int(get("context_length") or 4096),
        tie_word_embeddings="output.weight" not in tensors,
        sliding_window=int(window) if window else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_ids(meta.get("tokenizer.ggml.eos_token_id")),
        source_model_type=a,
    ) | dict(defaults) | present
