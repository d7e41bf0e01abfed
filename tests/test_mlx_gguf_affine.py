"""backends.mlx.gguf_affine: GGUF blocks as MLX affine quantization, checked exactly against our dequantizer.

"Exact" means np.array_equal with `StoredTensor.dequantize()`.  For Q4_1/Q5_1/Q4_K/Q5_K the float32 bits
agree too; Q4_0/Q5_0/Q8_0 compute d*q + (-8d) where ggml computes d*(q-8), which agree in value but
give +0.0 where ggml gives -0.0 (a negative d times zero, or a zero d times a negative q).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from test_gguf_quants import random_raw

from backends.mlx.gguf_affine import AffineWeight, pack_bits, to_affine
from backends.mlx.runtime import mx
from ir.formats.gguf_quants import row_bytes
from ir.weights import StoredTensor

MAPPED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"]
SIGNED_ZERO_ONLY = {"Q4_0", "Q5_0", "Q8_0"}  # see module docstring
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
SHAPES = [(3, 256), (64, 512), (5, 1024)]


def stored(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> StoredTensor:
    return StoredTensor(raw.reshape(shape[0], row_bytes(kind, shape[1])), kind, shape)


def mlx_dequantize(a: AffineWeight) -> np.ndarray:
    out = mx.dequantize(mx.array(a.wq), mx.array(a.scales), mx.array(a.biases), group_size=a.group_size, bits=a.bits)
    return np.array(out)


def check_exact(t: StoredTensor) -> AffineWeight:
    a = to_affine(t)
    assert isinstance(a, AffineWeight), a
    rows, cols = t.shape
    assert (a.group_size, a.bits) == (32, BITS[t.kind])
    assert a.wq.dtype == np.uint32 and a.wq.shape == (rows, cols * a.bits // 32)
    assert a.scales.dtype == a.biases.dtype == np.float32
    assert a.scales.shape == a.biases.shape == (rows, cols // 32)
    ours, ref = mlx_dequantize(a), t.dequantize()
    assert ours.dtype == np.float32
    assert np.array_equal(ours, ref)
    if t.kind in SIGNED_ZERO_ONLY:
        ours, ref = ours + np.float32(0), ref + np.float32(0)  # -0.0 + 0.0 == +0.0
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    return a


def check_matmul(t: StoredTensor, a: AffineWeight, rng: np.random.Generator) -> None:
    w = t.dequantize().astype(np.float64)
    for m in (1, 7):  # a matrix-vector and a matrix-matrix product take different kernels
        x = rng.standard_normal((m, t.shape[1])).astype(np.float32)
        out = mx.quantized_matmul(mx.array(x), mx.array(a.wq), mx.array(a.scales), mx.array(a.biases),
                                  transpose=True, group_size=a.group_size, bits=a.bits)
        ref = x.astype(np.float64) @ w.T
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        assert (np.abs(np.array(out) - ref) <= bound).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_is_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(3, 256), dtype=np.uint8)
    ones, zeros = mx.ones((3, 8)), mx.zeros((3, 8))
    back = mx.dequantize(mx.array(pack_bits(q, bits)), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(back), q)
    # And the other way round: mx.quantize's own words are the packing of the values they decode to.
    w = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    wq, _, _ = mx.quantize(w, group_size=32, bits=bits)
    q_mx = np.array(mx.dequantize(wq, ones, zeros, group_size=32, bits=bits)).astype(np.uint8)
    assert np.array_equal(pack_bits(q_mx, bits), np.array(wq))


@pytest.mark.parametrize("kind", MAPPED)
def test_random_valid_blocks_map_exactly(kind):
    rng = np.random.default_rng(T[kind].value)
    for shape, scale in zip(SHAPES, [1e-4, 0.05, 30.0], strict=True):  # 1e-4: many fp16 subnormal scales
        t = stored(kind, random_raw(kind, shape, rng, scale), shape)  # includes blocks with zero scales
        check_matmul(t, check_exact(t), rng)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_quantized_data_maps_exactly(kind):
    rng = np.random.default_rng(T[kind].value + 100)
    for shape, scale in zip(SHAPES, [1e-3, 1.0, 30.0], strict=True):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        x[:, :32] += scale  # blocks with a non-zero mean
        x[0] = 0.0  # all-zero blocks
        t = stored(kind, np.asarray(gq.quantize(x, T[kind])), shape)
        check_matmul(t, check_exact(t), rng)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q6_K"])
def test_16_element_sub_blocks_fall_back(kind):
    t = stored(kind, random_raw(kind, (2, 256), np.random.default_rng(0), 0.05), (2, 256))
    reason = to_affine(t)
    assert isinstance(reason, str) and reason.startswith(kind) and "16-element sub-blocks" in reason


def test_other_fallbacks():
    f16 = np.zeros((4, 64), np.float16)
    assert to_affine(StoredTensor(f16, "F16", (4, 64))) == "F16: not quantized"
    assert to_affine(StoredTensor(np.zeros((1, 256), np.uint8), "BF16", (128,))) == "BF16: not quantized"
    assert to_affine(StoredTensor(np.zeros((1, 8), np.uint8), "IQ2_XXS", (1, 256))).startswith("IQ2_XXS: no exact")
    # Never valid GGUF data, but the width is checked before the blocks are read.
    assert "row length 48 is not a multiple of 32" in to_affine(StoredTensor(np.zeros(0, np.uint8), "Q8_0", (2, 48)))
    assert "not a matrix" in to_affine(StoredTensor(np.zeros((1, 34), np.uint8), "Q8_0", (32,)))


def test_edge_cases():
    empty = to_affine(StoredTensor(np.zeros((0, 144), np.uint8), "Q4_K", (0, 256)))
    assert empty.wq.shape == (0, 32) and empty.scales.shape == (0, 8)
    with pytest.raises(ValueError, match="needs 4 blocks, got 3"):
        to_affine(StoredTensor(np.zeros((3, 34), np.uint8), "Q8_0", (2, 64)))
    # Q8_0 extremes: int8 -128 and 127 become unsigned 0 and 255.
    blk = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), np.full(16, -128, np.int8).view(np.uint8),
                          np.full(16, 127, np.int8).view(np.uint8)])
    a = check_exact(StoredTensor(blk.reshape(1, 34), "Q8_0", (1, 32)))
    assert np.array_equal(a.wq, [[0] * 4 + [0xFFFFFFFF] * 4]) and a.biases[0, 0] == -64


def test_smollm_tensors_map_or_give_a_reason(smollm):
    rng = np.random.default_rng(0)
    mapped: dict[str, int] = {}
    for name, t in smollm.weights.items():
        if not t.quantized:
            continue
        a = to_affine(t)
        if isinstance(a, str):
            assert a.startswith(t.kind + ": "), (name, a)
            continue
        mapped[t.kind] = mapped.get(t.kind, 0) + 1
        check_exact(t)
        if name in ("layers.0.wq", "layers.0.w_down"):
            check_matmul(t, a, rng)
    # SmolLM2-135M Q4_1: every quantized tensor maps (the embedding is Q8_0, norms are F32).
    assert mapped == {"Q4_1": 210, "Q8_0": 1}
