"""ir.fusion: each rewrite fires where it may and nowhere else, and a fused graph computes what the plain one does
(the interpreter runs both). tools/check_arch's "fused" engine runs every architecture's fused graph against
transformers; the backends' tests run their lowerings of it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from core.batch import make_batch
from ir.fusion import FusedWeights, Fusions, fuse
from ir.graph import Graph
from ir.interpreter import Interpreter, KVCache
from ir.models._decoder import step_inputs
from ir.rope import RopeSpec

H, HEADS, KV, D, INNER = 32, 4, 2, 8, 48
SPEC = RopeSpec(10000.0, D, "neox")


def block(*, tap: str = "") -> Graph:
    """One pre-norm decoder layer and a final norm; `tap` also outputs an intermediate value that fusion would
    otherwise hide inside a fused kernel ("act", "q_rope", "sum")."""
    g = Graph("t")
    s = step_inputs(g)
    x = g.embedding(g.param("embed", (64, H)), s.ids)
    h = g.rms_norm(x, g.param("n1", (H,)), eps=1e-6)
    proj = {n: g.linear(h, g.param(f"l.w{n}", (rows, H)), g.param(f"l.b{n}", (rows,)))
            for n, rows in (("q", HEADS * D), ("k", KV * D), ("v", KV * D))}
    q, k, v = (g.reshape(proj[n], shape=("T", heads, D)) for n, heads in (("q", HEADS), ("k", KV), ("v", KV)))
    qr, kr = g.rope(q, s.positions, spec=SPEC), g.rope(k, s.positions, spec=SPEC)
    a = g.attention(qr, kr, v, *s.attention, layer=0, scale=D ** -0.5)
    x = g.add(x, g.linear(g.reshape(a, shape=("T", HEADS * D)), g.param("l.wo", (H, HEADS * D))))
    h = g.rms_norm(x, g.param("n2", (H,)), eps=1e-6, offset=1.0)
    act = g.silu(g.linear(h, g.param("l.w_gate", (INNER, H))))
    m = g.mul(g.linear(h, g.param("l.w_up", (INNER, H))), act)  # the product's operands either way round
    x = g.add(x, g.linear(m, g.param("l.w_down", (H, INNER))))
    g.output("logits", g.linear(g.gather_rows(g.rms_norm(x, g.param("n3", (H,)), eps=1e-6), s.logits_rows),
                                g.param("embed", (64, H))))
    if tap:
        g.output(tap, {"act": act, "q_rope": qr, "sum": x}[tap])
    return g


def weights(g: Graph) -> dict[str, np.ndarray]:
    """Unit-variance outputs of every matrix, logits of several units (the embedding is the head)."""
    rng = np.random.default_rng(0)
    scale = {n: 1.0 if n in ("embed", "e") else p.shape[-1] ** -0.5 if len(p.shape) > 1 else 0.25
             for n, p in g.params.items()}
    return {n: (rng.standard_normal(p.shape) * scale[n]).astype(np.float32) for n, p in g.params.items()}


def run(g: Graph, w) -> dict[str, np.ndarray]:
    batch = make_batch([[1, 5, 9, 2, 7], [3, 4]], [0, 0], [[1, 0], [3, 2]], 4, all_logits=True)
    return Interpreter(g, w).run(batch.inputs(), KVCache.for_graph(g, 4, 4))


def ops(g: Graph) -> Counter:
    return Counter(n.op for n in g.nodes)


def test_every_rewrite_fires_and_the_fused_graph_computes_the_same():
    g = block()
    f = fuse(g)
    assert ops(f) == Counter({"linear": 5, "slice": 5, "reshape": 4, "rope_attention": 1, "add_rms_norm": 2,
                              "gated": 1, "embedding": 1, "rms_norm": 1, "gather_rows": 1})
    fused = {n: p.parts for n, p in f.params.items() if p.parts}
    assert fused == {"l.wq+wk+wv": ("l.wq", "l.wk", "l.wv"), "l.bq+bk+bv": ("l.bq", "l.bk", "l.bv"),
                     "l.w_gate+w_up": ("l.w_gate", "l.w_up")}
    assert not {"l.wq", "l.bk", "l.w_up"} & set(f.params)  # parts nothing else reads are gone
    assert next(n for n in f.nodes if n.op == "gated").attrs == {"act": "silu"}
    assert [n.attrs["offset"] for n in f.nodes if n.op == "add_rms_norm"] == [1.0, 0.0]
    w = weights(g)
    want, got = run(g, w)["logits"], run(f, FusedWeights(f, w))["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert float(np.abs(want).max()) > 1.0  # logits that a wrong slice or a swapped gate would move


def test_rope_pairs_where_the_attention_does_not_rotate():
    f = fuse(block(), fusions=Fusions(rope_attention=False))
    assert ops(f)["rope_pair"] == 1 and ops(f)["attention"] == 1 and not ops(f)["rope"]
    w = weights(block())
    np.testing.assert_allclose(run(f, FusedWeights(f, w))["logits"], run(block(), w)["logits"], rtol=1e-6,
                               atol=1e-6)


def test_no_fusions_is_the_plain_graph():
    g = block()
    f = fuse(g, fusions=Fusions.none())
    assert [(n.op, n.outs) for n in f.nodes] == [(n.op, n.outs) for n in g.nodes] and f.params == g.params


def test_only_parts_of_one_format_are_concatenated():
    """A Q4_K_M file's q and k are Q4_K and its v Q6_K: q and k fuse, v runs alone; biases must agree too."""
    formats = {"l.wq": "Q4_K", "l.wk": "Q4_K", "l.wv": "Q6_K", "l.w_gate": "Q4_K", "l.w_up": "Q6_K"}
    f = fuse(block(), formats)
    assert {n: p.parts for n, p in f.params.items() if p.parts} == {
        "l.wq+wk": ("l.wq", "l.wk"), "l.bq+bk": ("l.bq", "l.bk")}
    assert {"l.wv", "l.bv", "l.w_gate", "l.w_up"} <= set(f.params)
    w = weights(block())
    np.testing.assert_allclose(run(f, FusedWeights(f, w))["logits"], run(block(), w)["logits"], rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("tap,gone", [("act", "gated"), ("q_rope", "rope_attention"), ("sum", None)])
def test_a_value_read_elsewhere_stays_a_value(tap, gone):
    """What another reader (here a graph output) needs is never folded into a kernel that does not produce it; an
    add's sum is one of add_rms_norm's results, so that fusion stays."""
    g = block(tap=tap)
    f = fuse(g)
    if gone:
        assert not ops(f)[gone]
    w = weights(g)
    want, got = run(g, w), run(f, FusedWeights(f, w))
    for name in ("logits", tap):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_a_rope_read_before_its_partner_is_not_paired():
    """A pair runs where its later rope stood, so a reader of the earlier one in between keeps them apart."""
    g = Graph("t")
    s = step_inputs(g)
    x = g.reshape(g.embedding(g.param("e", (16, 2 * D)), s.ids), shape=("T", 2, D))
    first = g.rope(x, s.positions, spec=SPEC)
    between = g.add(first, x)
    second = g.rope(between, s.positions, spec=SPEC)
    g.output("logits", g.add(first, second))
    assert ops(fuse(g))["rope"] == 2


def test_ir_dump_prints_smollm_fused_graph(smollm_path, capsys):
    """The default SmolLM2 file (Q4_1 everywhere but its F16/F32 norms): q/k/v and gate/up of every layer fuse, the
    table shows what each fused parameter was made of."""
    from tools import ir_dump

    assert ir_dump.main([str(smollm_path), "--fused"]) == 0
    out = capsys.readouterr().out
    layers = 30
    assert out.count("= rope_attention(") == layers and "= attention(" not in out
    assert out.count("= slice(") == 5 * layers and out.count("= gated(") == layers  # q, k, v; gate, up
    row = next(line for line in out.splitlines() if line.startswith("layers.0.wq+wk+wv "))
    assert "Q4_1" in row and "blk.0.attn_q.weight + blk.0.attn_k.weight + blk.0.attn_v.weight" in row
