"""The IR itself: shape inference, the printer, rope tables, and paged attention's contract."""

from __future__ import annotations

import numpy as np
import pytest

from core.batch import make_batch
from ir.graph import Graph
from ir.interpreter import KVCache, _rope, paged_attention
from ir.printer import format_graph, format_params
from ir.rope import RopeSpec, inv_freq
from ir.weights import StoredTensor, rope_unpermute_rows


def test_shape_inference_and_errors():
    g = Graph("t")
    x = g.input("x", ("T", 8), "f32")
    w = g.param("w", (16, 8))
    y = g.linear(x, w)
    assert y.shape == ("T", 16) and y.dtype == "f32"
    assert g.reshape(y, shape=("T", 4, 4)).shape == ("T", 4, 4)
    with pytest.raises(ValueError, match="linear in-features: 16 != 8"):
        g.linear(y, w)
    with pytest.raises(ValueError, match="cannot reshape"):
        g.reshape(y, shape=("T", 5, 4))
    with pytest.raises(ValueError, match="cannot reshape"):
        g.reshape(y, shape=(4, 4))  # a symbolic dim cannot vanish
    ids = g.input("ids", ("T",), "i32")
    with pytest.raises(ValueError, match="must be a float tensor"):
        g.silu(ids)
    with pytest.raises(ValueError, match="redeclared"):
        g.param("w", (8, 8))
    with pytest.raises(KeyError, match="unknown IR op"):
        g.op("conv3d", x)


def test_attention_inference_checks_heads():
    g = Graph("t")
    meta = [g.input(n, s, "i32") for n, s in
            [("slot_mapping", ("T",)), ("block_tables", ("B", "M")), ("context_lens", ("B",)),
             ("query_start", ("B1",))]]
    q = g.input("q", ("T", 6, 16), "f32")
    k = g.input("k", ("T", 4, 16), "f32")
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        g.attention(q, k, k, *meta, layer=0, scale=0.25)
    k2 = g.input("k2", ("T", 2, 16), "f32")
    assert g.attention(q, k2, k2, *meta, layer=0, scale=0.25).shape == ("T", 6, 16)


def test_printer_shows_ops_and_params(smollm):
    text = format_graph(smollm.graph)
    assert text.count("= attention(") == smollm.config.num_layers
    assert "rope(theta=100000, dim=64, neox)" in text
    assert "output logits" in text
    table = format_params(smollm.graph, smollm.weights.kinds(), smollm.sources)
    assert "layers.0.wq" in table and "Q4_1" in table and "blk.0.attn_q.weight" in table
    n_elems = sum(int(np.prod(p.shape)) for p in smollm.graph.params.values())
    assert f"{n_elems:,} elements" in table


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, HF -> GGUF
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_qk_unpermute_inverts_llamacpp_and_matches_rope_styles():
    rng = np.random.default_rng(0)
    n_head, d, hidden = 3, 8, 5
    w = rng.standard_normal((n_head * d, hidden)).astype(np.float32)
    gg = _llamacpp_permute(w, n_head)
    back = StoredTensor(gg, "F32", w.shape).permute_rows(rope_unpermute_rows(n_head * d, n_head))
    np.testing.assert_array_equal(back.data, w)
    # Why the permutation exists: interleaved rope on permuted rows == neox rope on HF rows.
    x = rng.standard_normal((4, hidden)).astype(np.float32)
    pos = np.arange(4, dtype=np.int32) * 7
    neox = _rope((x @ w.T).reshape(4, n_head, d), pos, RopeSpec(10000.0, d, "neox"))
    inter = _rope((x @ gg.T).reshape(4, n_head, d), pos, RopeSpec(10000.0, d, "interleaved"))
    np.testing.assert_allclose(inter.reshape(4, -1), _llamacpp_permute(neox.reshape(4, -1).T, n_head).T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
])
def test_rope_scaling_matches_transformers(params):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ir.config import hf_rope

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=8192,
                      rope_parameters={"rope_theta": 50000.0, **params})
    ref, ref_attn = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, torch.device("cpu"))
    spec = hf_rope(cfg.to_dict(), 64)
    ours, attn = inv_freq(spec)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    assert attn == pytest.approx(ref_attn)


def test_hf_rope_reads_theta_from_either_place():
    from ir.config import hf_rope

    assert hf_rope({"rope_theta": 5e5}, 64).theta == 5e5
    assert hf_rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, 64).theta == 1e6
    assert hf_rope({"partial_rotary_factor": 0.5, "rope_theta": 1e4}, 64).rotary_dim == 32


def _dense_attention(q, k, v, scale, window=None):
    t, hq, _ = q.shape
    rep = hq // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = j <= i if window is None else (j <= i) & (j > i - window)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense_across_chunks(window):
    """Two sequences, shuffled blocks, prefilled in uneven chunks then decoded: every output row
    equals plain causal attention over the whole sequence."""
    rng = np.random.default_rng(1)
    bs, hq, hkv, d = 4, 6, 2, 8
    lens = [13, 7]
    qkv = [[rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv)] for n in lens]
    tables = [list(rng.permutation(16)[:4]), []]
    tables[1] = [b for b in rng.permutation(16) if b not in tables[0]][:2]
    cache = KVCache([np.full((16, bs, hkv, d), np.nan, np.float32)], [np.full((16, bs, hkv, d), np.nan,
                                                                              np.float32)], bs)
    outs = [np.zeros((n, hq, d), np.float32) for n in lens]
    done = [0, 0]
    for step in ([5, 3], [6, 2], [1, 1], [1, 1]):
        chunks = [list(range(done[b], done[b] + step[b])) for b in range(2)]
        batch = make_batch(chunks, done, tables, bs, all_logits=True)
        q = np.concatenate([qkv[b][0][c] for b, c in enumerate(chunks)])
        k = np.concatenate([qkv[b][1][c] for b, c in enumerate(chunks)])
        v = np.concatenate([qkv[b][2][c] for b, c in enumerate(chunks)])
        o = paged_attention(q, k, v, batch.slot_mapping, batch.block_tables, batch.context_lens,
                            batch.query_start, cache=cache, layer=0, scale=d**-0.5, sliding_window=window)
        for b, c in enumerate(chunks):
            outs[b][c] = o[batch.query_start[b]:batch.query_start[b + 1]]
            done[b] += len(c)
    for b in range(len(lens)):
        ref = _dense_attention(*qkv[b], d**-0.5, window)
        np.testing.assert_allclose(outs[b], ref, rtol=1e-5, atol=1e-5)


def test_rope_specs_with_list_parameters_hash():
    """HF rope parameters that are lists (longrope's factors, an mrope section) must not make the spec unhashable."""
    from ir.config import hf_rope

    spec = hf_rope({"rope_theta": 1e4, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 2.0],
                                                        "long_factor": [3.0, 4.0], "factor": 2.0}}, 4)
    assert hash(spec) == hash(hf_rope({"rope_theta": 1e4, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0], "factor": 2.0}}, 4))
    assert dict(spec.scaling)["long_factor"] == (3.0, 4.0)
