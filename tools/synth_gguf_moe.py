"""The Qwen3-30B-A3B shape for tools.synth_gguf: a qwen3moe GGUF as llama.cpp's converter writes it (its
`qwen3moe.*` keys; per layer q/k/v/o with per-head q/k RMSNorms, the router `ffn_gate_inp` and the expert stacks
`ffn_{gate,up,down}_exps`), checked against llama.cpp's src/models/qwen3moe.cpp and gguf-py's tensor table.

Two departures from the checkpoint, both for the benchmark's sake: the vocabulary is the llama-bpe vocab file's
(128256 tokens, not Qwen3's 151936: llama.cpp needs the tokenizer metadata to match the embedding, and that file is
the tokenizer at hand), and the default is 16 of its 48 layers (F16 at 48 layers is ~61 GB, the GPU machine's whole
disk; 16 layers are ~21 GB F16 and ~6 GB Q4_K_M).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Qwen3MoEShape:
    """Hyper-parameters; the defaults are tests/data/hf_configs/qwen3-30b-a3b.json's but for vocab and layers."""

    arch: ClassVar[str] = "qwen3moe"
    title: ClassVar[str] = "synthetic-qwen3-30b-a3b-shape"

    vocab: int = 128256
    hidden: int = 2048
    intermediate: int = 6144  # feed_forward_length: the checkpoint's dense width, which no layer here uses
    expert_intermediate: int = 768
    experts: int = 128
    top_k: int = 8
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    layers: int = 16
    rope_theta: float = 1000000.0
    context: int = 40960
    rms_eps: float = 1e-6

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape): numpy's order is GGUF's reversed, so an expert stack is [experts, out, in]
        (ggml's {in, out, experts}, as qwen3moe.cpp creates ffn_gate_exps {n_embd, n_ff_exp, n_expert}). Qwen's rope
        is neox-style, so q/k rows are in the checkpoint's order (llama.cpp permutes only llama's)."""
        h, q, kv, e, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.experts, \
            self.expert_intermediate
        out = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)),
                    (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, q)),
                    (b + "attn_q_norm.weight", (self.head_dim,)), (b + "attn_k_norm.weight", (self.head_dim,)),
                    (b + "ffn_norm.weight", (h,)), (b + "ffn_gate_inp.weight", (e, h)),
                    (b + "ffn_gate_exps.weight", (e, f, h)), (b + "ffn_up_exps.weight", (e, f, h)),
                    (b + "ffn_down_exps.weight", (e, h, f))]
        return out + [("output_norm.weight", (h,)), ("output.weight", (self.vocab, h))]

    def add_arch_metadata(self, w) -> None:
        """What convert_hf_to_gguf.py's Qwen3MoeModel writes (no rope.dimension_count: llama.cpp takes head_dim)."""
        w.add_context_length(self.context)
        w.add_embedding_length(self.hidden)
        w.add_block_count(self.layers)
        w.add_feed_forward_length(self.intermediate)
        w.add_expert_feed_forward_length(self.expert_intermediate)
        w.add_head_count(self.heads)
        w.add_head_count_kv(self.kv_heads)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        w.add_rope_freq_base(self.rope_theta)
        w.add_layer_norm_rms_eps(self.rms_eps)
        w.add_expert_count(self.experts)
        w.add_expert_used_count(self.top_k)
        w.add_vocab_size(self.vocab)
