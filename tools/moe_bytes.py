"""The share of an expert stack a decode step reads: with `tokens` tokens each routed to `top_k` of `experts`
experts at random, the expected fraction of distinct experts picked (top_k / experts for one token). Both the
synthetic-model benchmark (tools.bench_gpu_model) and the GGUF one (tools.bench_gguf_report) count a MoE's
roofline bytes with it, so their figures compare."""

from __future__ import annotations


def expert_share(top_k: int, experts: int, tokens: int = 1) -> float:
    return 1 - (1 - top_k / experts) ** tokens
