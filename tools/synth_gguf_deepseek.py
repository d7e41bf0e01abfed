"""The DeepSeek-V2-Lite shape for tools.synth_gguf: a deepseek2 GGUF as llama.cpp's convert_hf_to_gguf.py
(DeepseekV2Model) writes it, checked against llama.cpp's src/models/deepseek2.cpp and gguf-py's tensor table. MLA
as MQA over the latent: key/value_length are the latent's (kv_lora_rank + qk_rope_head_dim, kv_lora_rank), the
heads' widths under the _mla keys, kv_b_proj split per head into attn_k_b (transposed) and attn_v_b; q projected
directly (attn_q: V2-Lite has no q_lora_rank); layer 0 a dense MLP, the rest 64 routed experts (softmax, top 6,
weights neither normalized nor scaled) beside 2 shared ones as one MLP of twice the width; yarn (factor 40 over
4096 positions) with the converter's log multiplier 0.1 * mscale_all_dim.

Three departures from the checkpoint, all for the benchmark's sake: the vocabulary is the llama-bpe vocab file's
(128256 tokens, not V2-Lite's 102400: llama.cpp needs the tokenizer metadata to match the embedding, and that file is
the tokenizer at hand); the default is 12 of its 27 layers (F16 14.09 GB, llama-quantize's Q4_K_M 4.66 GB: room
beside another shape's files on the GPU machine's 64 GB disk; at 27 layers F16 alone is 31.6 GB); and at a layer
count other than 26 or 27 the file says `attention.q_lora_rank = 0`, which the converter leaves out: llama.cpp tells
a q-less ("lite") deepseek2 by its layer count and otherwise requires the key, and 0 selects the direct attn_q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

LITE_LAYER_COUNTS = (26, 27)  # llama_model_deepseek2::load_arch_hparams: is_lite needs no q_lora_rank key


@dataclass(frozen=True)
class DeepseekV2LiteShape:
    """Hyper-parameters; the defaults are tests/data/hf_configs/deepseek-v2-lite.json's but for vocab and layers."""

    arch: ClassVar[str] = "deepseek2"
    title: ClassVar[str] = "synthetic-deepseek-v2-lite-shape"

    vocab: int = 128256
    hidden: int = 2048
    intermediate: int = 10944  # the dense layers' MLP
    expert_intermediate: int = 1408
    experts: int = 64
    top_k: int = 6
    shared_experts: int = 2
    dense_layers: int = 1  # first_k_dense_replace
    heads: int = 16
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    layers: int = 12
    rope_theta: float = 10000.0
    context: int = 163840
    rms_eps: float = 1e-6
    routed_scaling: float = 1.0
    yarn_factor: float = 40.0
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    mscale_all_dim: float = 0.707

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape): numpy's order is GGUF's reversed, so attn_k_b is [heads, rank, nope] (ggml's
        {nope, rank, heads}, as deepseek2.cpp creates wk_b) and an expert stack [experts, out, in]. No q/k
        permutation: llama.cpp's rope for deepseek2 is the interleaved one the checkpoint uses."""
        h, heads, rank, rope = self.hidden, self.heads, self.kv_lora_rank, self.qk_rope_head_dim
        e, f, shared = self.experts, self.expert_intermediate, self.expert_intermediate * self.shared_experts
        out = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (heads * (self.qk_nope_head_dim + rope), h)),
                    (b + "attn_kv_a_mqa.weight", (rank + rope, h)), (b + "attn_kv_a_norm.weight", (rank,)),
                    (b + "attn_k_b.weight", (heads, rank, self.qk_nope_head_dim)),
                    (b + "attn_v_b.weight", (heads, self.v_head_dim, rank)),
                    (b + "attn_output.weight", (h, heads * self.v_head_dim)), (b + "ffn_norm.weight", (h,))]
            if i < self.dense_layers:
                out += [(b + "ffn_gate.weight", (self.intermediate, h)), (b + "ffn_up.weight", (self.intermediate, h)),
                        (b + "ffn_down.weight", (h, self.intermediate))]
            else:
                out += [(b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, f, h)),
                        (b + "ffn_up_exps.weight", (e, f, h)), (b + "ffn_down_exps.weight", (e, h, f)),
                        (b + "ffn_gate_shexp.weight", (shared, h)), (b + "ffn_up_shexp.weight", (shared, h)),
                        (b + "ffn_down_shexp.weight", (h, shared))]
        return out + [("output_norm.weight", (h,)), ("output.weight", (self.vocab, h))]

    def add_arch_metadata(self, w) -> None:
        """What DeepseekV2Model writes from V2-Lite's config.json, in its order: TextModel's keys (num_key_value_heads
        forced to 1, yarn from rope_scaling, n_group/topk_group, softmax from scoring_func), then its own."""
        import gguf

        w.add_block_count(self.layers)
        w.add_context_length(self.context)
        w.add_embedding_length(self.hidden)
        w.add_feed_forward_length(self.intermediate)
        w.add_head_count(self.heads)
        w.add_head_count_kv(1)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(self.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(self.yarn_original_context)
        w.add_rope_scaling_yarn_beta_fast(self.yarn_beta_fast)
        w.add_rope_scaling_yarn_beta_slow(self.yarn_beta_slow)
        w.add_rope_freq_base(self.rope_theta)
        w.add_layer_norm_rms_eps(self.rms_eps)
        w.add_expert_used_count(self.top_k)
        w.add_expert_group_count(1)
        w.add_expert_group_used_count(1)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_leading_dense_block_count(self.dense_layers)
        w.add_vocab_size(self.vocab)
        if self.layers not in LITE_LAYER_COUNTS:
            w.add_q_lora_rank(0)
        w.add_kv_lora_rank(self.kv_lora_rank)
        w.add_key_length(self.kv_lora_rank + self.qk_rope_head_dim)
        w.add_value_length(self.kv_lora_rank)
        w.add_key_length_mla(self.qk_nope_head_dim + self.qk_rope_head_dim)
        w.add_value_length_mla(self.v_head_dim)
        w.add_expert_feed_forward_length(self.expert_intermediate)
        w.add_expert_count(self.experts)
        w.add_expert_shared_count(self.shared_experts)
        w.add_expert_weights_scale(self.routed_scaling)  # norm_topk_prob false: no expert_weights_norm key
        w.add_rope_dimension_count(self.qk_rope_head_dim)
        w.add_rope_scaling_yarn_log_mul(0.1 * self.mscale_all_dim)
