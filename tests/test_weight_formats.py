"""The weight-format registry (ir/weight_formats.py) and the stored-tensor operations built on it: layouts and shapes
of every format, N-D (expert-stack) tensors, row splits of quantized blocks (fused q/k/v), against gguf-py's own
quantizer and our per-row decoding."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ir.graph import Graph
from ir.ops import OPS
from ir.weight_formats import FORMATS, weight_format
from ir.weights import StoredTensor


def q8_0(x: np.ndarray) -> StoredTensor:
    """x quantized by gguf-py (an independent packer), as the GGUF reader hands it out: [rows, row bytes]."""
    blocks = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), Q.Q8_0)
    return StoredTensor(blocks, "Q8_0", x.shape)


def test_every_format_knows_its_layout():
    # intgroup and fp8 formats enter the table as checkpoints (or --isq) name them: their group size is a
    # checkpoint's, so which are there depends on what this process loaded before
    assert {f.family for f in FORMATS.values()} - {"intgroup", "fp8"} == {"dense", "gguf"}
    weight_format("I4_G128"), weight_format("F8E4M3_G128")  # one of each, whatever ran before
    assert {f.family for f in FORMATS.values()} == {"dense", "gguf", "intgroup", "fp8"}
    for name, f in FORMATS.items():
        assert f.name == name and f.quantized == (f.family != "dense")
        row = 4 * f.block_elems
        assert f.stored_shape((3, row)) == (3, 4 * f.block_bytes)
        assert f.stored_shape((2, 3, row)) == (6, 4 * f.block_bytes)  # a stack of matrices: rows of every one
    assert weight_format("BF16").block_bytes == 2 and weight_format("Q4_K").block_elems == 256
    with pytest.raises(ValueError, match="unknown weight format 'IQ2_XXS'"):
        weight_format("IQ2_XXS")
    with pytest.raises(ValueError, match="not a whole number"):
        weight_format("Q8_0").row_bytes(48)


def test_three_d_tensors_decode_as_their_matrices():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 64)).astype(np.float32)  # 2 experts of [4, 64]
    t = q8_0(x)
    assert t.quantized and t.format.stored_shape(t.shape) == t.data.shape
    full = t.dequantize()
    assert full.shape == (2, 4, 64)
    for e in range(2):
        np.testing.assert_array_equal(full[e], q8_0(x[e]).dequantize())
    assert np.abs(full - x).max() < 0.02 * np.abs(x).max()  # and it is x, to Q8_0's precision


def test_row_splits_of_quantized_blocks():
    """A fused [q; k; v] matrix split by rows gives each part's own quantized rows, unchanged."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 96)).astype(np.float32)
    t = q8_0(x)
    parts = [t.rows(0, 6), t.rows(6, 8), t.rows(8, 10)]
    assert [p.shape for p in parts] == [(6, 96), (2, 96), (2, 96)] and all(p.kind == "Q8_0" for p in parts)
    np.testing.assert_array_equal(np.concatenate([p.dequantize() for p in parts]), t.dequantize())
    dense = StoredTensor(x, "F32", x.shape).rows(2, 5)
    np.testing.assert_array_equal(dense.values(), x[2:5])
    offset = StoredTensor(x[0].astype(np.float16), "F16", (96,)).dense_map(lambda w: w + 1)
    assert offset.kind == "F32" and np.allclose(offset.values(), x[0].astype(np.float16).astype(np.float32) + 1)


def test_matrix_params_are_the_ops_weight_operands():
    for op in OPS.values():
        assert all(i < len(op.operands) for i in op.weights)
    g = Graph("t")
    ids = g.input("ids", ("T",), "i32")
    h = g.embedding(g.param("embed", (8, 4)), ids)
    h = g.rms_norm(h, g.param("norm", (4,)), eps=1e-5)
    g.output("y", g.linear(h, g.param("w", (6, 4)), g.param("b", (6,))))
    assert g.matrix_params() == {"embed", "w"}


def test_int_group_formats_by_name():
    f = weight_format("I4_G128")
    assert (f.family, f.block_elems, f.block_bytes, f.int_group) == ("intgroup", 128, 8 + 64, (4, 128))
    assert weight_format("I8_G4096").stored_shape((3, 8192)) == (3, 2 * (8 + 4096))
    with pytest.raises(ValueError, match="supported widths are 4, 8"):
        weight_format("I3_G128")
    with pytest.raises(ValueError, match="multiple of 32"):
        weight_format("I4_G48")


def test_int_groups_decode_exactly_and_keep_act_order_through_row_splits():
    """(q - z) * s bit for bit from the affine blocks (fp16 scales); row splits keep the input order of act-order
    columns, so a fused q/k/v split decodes as the whole does."""
    from ir.formats import int_groups

    rng = np.random.default_rng(0)
    q, z = rng.integers(0, 16, (6, 64)), rng.integers(0, 16, (6, 2))
    s = rng.standard_normal((6, 2)).astype(np.float16).astype(np.float32)
    want = (q - np.repeat(z, 32, axis=1)) * np.repeat(s, 32, axis=1)
    perm = rng.permutation(64).astype(np.int32)
    t = StoredTensor(int_groups.pack(q, s, z, 4, 32), "I4_G32", (6, 64), input_perm=perm)
    np.testing.assert_array_equal(int_groups.dequantize(t.data, t.shape, 4, 32), want)
    full = t.dequantize()
    np.testing.assert_array_equal(full[:, perm], want)
    np.testing.assert_array_equal(t.rows(2, 5).dequantize(), full[2:5])
    np.testing.assert_array_equal(t.as_elements().data, full)
