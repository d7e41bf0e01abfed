"""The bytes a MoE's decode step reads. expert_share: with `tokens` tokens each routed to `top_k` of `experts`
experts at random, the expected fraction of distinct experts picked (top_k / experts for one token); tensor_part:
which part of the model a GGUF tensor is, so that a report can say where the rest of the bytes go (attention,
shared experts, dense layers). Both the synthetic-model benchmark (tools.bench_gpu_model) and the GGUF one
(tools.bench_gguf_report) count a MoE's roofline bytes with expert_share, so their figures compare."""

from __future__ import annotations

ROUTED = "routed experts"
PARTS = ("attention", ROUTED, "shared experts", "router", "dense ffn", "output", "embedding")


def expert_share(top_k: int, experts: int, tokens: int = 1) -> float:
    return 1 - (1 - top_k / experts) ** tokens


def tensor_part(name: str) -> str:
    """One of PARTS for a tensor of llama.cpp's naming (a layer's norms go with what they feed: attn_norm and MLA's
    attn_kv_a_norm with attention, ffn_norm with the dense ffn)."""
    if name.startswith("token_embd."):
        return "embedding"
    if not name.startswith("blk."):
        return "output"  # output.weight, output_norm.weight
    base = name.split(".")[2]
    if base.startswith("attn_"):
        return "attention"
    if base.endswith("_exps"):
        return ROUTED
    if base.endswith("_shexp"):
        return "shared experts"
    if base in ("ffn_gate_inp", "exp_probs_b"):
        return "router"
    return "dense ffn"
