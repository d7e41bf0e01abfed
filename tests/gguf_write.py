"""What the tests that write GGUF files share: a tensor added in F32, F16 or Q8_0 (gguf-py quantizing, an independent
packer), and the file written out."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# Matrices cycle through these, so one file holds every kind the tests read (and quantized splits of fused tensors).
MIX = (Q.F32, Q.F16, Q.Q8_0)


class TypeCycle:
    """The type each tensor of a file is written in: matrices take `types` in turn from `start`, 1-D tensors F32."""

    def __init__(self, types: tuple[Q, ...] = MIX, start: int = 0):
        self.types, self.n = types, start

    def __call__(self, data: np.ndarray) -> Q:
        if data.ndim != 2:
            return Q.F32
        self.n += 1
        return self.types[(self.n - 1) % len(self.types)]


def add_decoder_sizes(w: gguf.GGUFWriter, cfg) -> None:
    """The keys every llama.cpp decoder reads, from a transformers config: layers, context, widths, heads."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def add_rms_decoder(w: gguf.GGUFWriter, cfg) -> None:
    """add_decoder_sizes, and the RMSNorm epsilon and rope base a llama-like decoder's GGUF carries."""
    add_decoder_sizes(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])


def add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q = Q.F32) -> Q:
    """fp32 `data` stored as `qtype` (F32, F16 or Q8_0); returns qtype."""
    if qtype == Q.F16:
        data = data.astype(np.float16)
    elif qtype == Q.Q8_0:
        data = gguf.quants.quantize(data, qtype)
    w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype if qtype == Q.Q8_0 else None)
    return qtype


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_kquant_llama(path, rng: np.random.Generator, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                       vocab: int, context: int, norm) -> None:
    """A llama GGUF of random valid Q4_K and Q6_K blocks where llama-quantize's Q4_K_M puts them (Q6_K for v, down
    and the head), an F32 embedding and norms of `norm(width)`."""
    from test_gguf_quants import random_raw

    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, context), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                   (w.add_rope_dimension_count, hidden // heads), (w.add_vocab_size, vocab)):
        add(v)
    kv = hidden // heads * kv_heads

    def mat(name, rows, cols, qtype):
        raw = random_raw(qtype, (rows, cols), rng, 2e-3).reshape(rows, -1)
        w.add_tensor(name, raw, raw_dtype=getattr(Q, qtype))

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(hidden))
    mat("output.weight", vocab, hidden, "Q6_K")
    for i in range(layers):
        b = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(b + name + ".weight", norm(hidden))
        for name, rows, cols, qtype in (("attn_q", hidden, hidden, "Q4_K"), ("attn_k", kv, hidden, "Q4_K"),
                                        ("attn_v", kv, hidden, "Q6_K"), ("attn_output", hidden, hidden, "Q4_K"),
                                        ("ffn_gate", ffn, hidden, "Q4_K"), ("ffn_up", ffn, hidden, "Q4_K"),
                                        ("ffn_down", hidden, ffn, "Q6_K")):
            mat(b + name + ".weight", rows, cols, qtype)
    finish(w)
