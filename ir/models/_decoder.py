"""The frame a decoder-only graph puts around its layers: the step's inputs (the `core.batch` contract), the token
embedding, and the logits of the rows asked for (tied to the embedding or not)."""

from __future__ import annotations

from dataclasses import dataclass

from core.batch import ATTENTION_INPUTS
from ir.config import ModelConfig
from ir.graph import Graph, Value


@dataclass
class StepInputs:
    ids: Value
    positions: Value
    attention: list[Value]  # ATTENTION_INPUTS, in order: what every attention node takes after q, k, v
    logits_rows: Value


def step_inputs(g: Graph) -> StepInputs:
    ids = g.input("token_ids", ("T",), "i32")
    pos = g.input("positions", ("T",), "i32")
    meta = [g.input("slot_mapping", ("T",), "i32"), g.input("block_tables", ("B", "M"), "i32"),
            g.input("context_lens", ("B",), "i32"), g.input("query_start", ("B1",), "i32")]
    assert [m.name for m in meta] == list(ATTENTION_INPUTS)
    return StepInputs(ids, pos, meta, g.input("logits_indices", ("N",), "i32"))


def embed(g: Graph, cfg: ModelConfig, ids: Value) -> tuple[Value, Value]:
    """(hidden states, the embedding table)."""
    table = g.param("embed", (cfg.vocab_size, cfg.hidden_size), shard="column")
    return g.embedding(table, ids), table


def logits(g: Graph, cfg: ModelConfig, h: Value, table: Value, rows: Value, bias: bool = False) -> Value:
    """The final hidden states at `rows` through the LM head (the embedding when tied; phi's has a bias). The
    builder outputs it as "logits", after whatever its architecture does to logits (a softcap, a scale). A pooled
    config's graph has no head: the hidden states at `rows` themselves (see `output_name`)."""
    if cfg.pooled:
        return g.gather_rows(h, rows)
    head = table if cfg.tie_word_embeddings else g.param("lm_head", (cfg.vocab_size, cfg.hidden_size),
                                                         shard="column")
    b = g.param("lm_head_b", (cfg.vocab_size,), shard="column") if bias else None
    return g.linear(g.gather_rows(h, rows), head, b)


def output_name(cfg: ModelConfig) -> str:
    """What a builder that serves embeddings names its result: "hidden" (no head ran), else "logits"."""
    return "hidden" if cfg.pooled else "logits"


def layer_norm(g: Graph, x: Value, name: str, size: int, eps: float) -> Value:
    """A LayerNorm with its weight `name` and bias `name_b` (phi's, stablelm's)."""
    return g.layer_norm(x, g.param(name, (size,)), g.param(f"{name}_b", (size,)), eps=eps)
