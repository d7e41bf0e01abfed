"""Tests for ir.formats.gguf_quants against gguf-py and a literal scalar port.

Tolerance used throughout (``assert_matches``): elementwise
``|ours - ref| <= 1e-6 * max(1, |ref|)``, i.e. 1e-6 absolute for values of
magnitude <= 1 and 1e-6 relative above that (needed only because k-quant test
data reaches magnitudes of ~100, where one float32 ulp is ~8e-6).  In practice
the vectorized comparisons are bit-exact; the tolerance exists so that the
double-precision scalar reference below can use the same check.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from ggml_scalar_ref import scalar_block
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from ir.formats import gguf_quants as gqz

ALL_TYPES = list(gqz.QTYPES)
EXPECTED_TYPES = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
]  # fmt: skip

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h).
# Random bytes there would give NaN/inf/huge scales, so test data overwrites
# them with sane finite values.
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def assert_matches(ours: np.ndarray, ref: np.ndarray) -> None:
    """See module docstring for the tolerance's meaning."""
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    ref = ref.astype(np.float64)
    assert np.isfinite(ref).all(), "test data must not contain NaN/inf"
    assert np.isfinite(ours).all()
    err = np.abs(ours.astype(np.float64) - ref)
    bound = 1e-6 * np.maximum(1.0, np.abs(ref))
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert (err <= bound).all(), (
        f"max abs err {err.max():.3g} at flat index {worst} "
        f"(ours {ours.reshape(-1)[worst]!r}, ref {ref.reshape(-1)[worst]!r})"
    )


def gguf_ref(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's dequantization, reshaped to our row-major ``shape``."""
    s = gqz.QTYPES[name]
    rows = raw.reshape(-1).view(np.uint8)
    n_cols = shape[-1] if shape else 1
    rows = rows.reshape(-1, gqz.row_bytes(name, n_cols))
    return np.asarray(gq.dequantize(rows, T(s.ggml_type)), dtype=np.float32).reshape(shape)


def _probe_quantizable() -> list[str]:
    ok = []
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    for name in ALL_TYPES:
        try:
            gq.quantize(x, T[name])
        except (NotImplementedError, gq.QuantError):
            continue
        ok.append(name)
    return ok


GGUF_QUANTIZABLE = _probe_quantizable()


# --------------------------------------------------------------------------
# Spec / metadata
# --------------------------------------------------------------------------


def test_qtypes_cover_required_types_and_agree_with_gguf_constants():
    assert list(gqz.QTYPES) == EXPECTED_TYPES
    for name, s in gqz.QTYPES.items():
        assert s.name == name
        assert s.ggml_type == int(T[name])
        assert (s.block_size, s.type_size) == gguf.GGML_QUANT_SIZES[T[name]]


def test_spec_lookup_forms():
    q4k = gqz.QTYPES["Q4_K"]
    assert gqz.spec("Q4_K") is q4k
    assert gqz.spec("q4_k") is q4k
    assert gqz.spec(12) is q4k
    assert gqz.spec(T.Q4_K) is q4k
    assert gqz.spec(np.int32(12)) is q4k
    assert gqz.spec("bf16").ggml_type == 30
    with pytest.raises(dataclasses.FrozenInstanceError):
        q4k.block_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["Q9_9", "IQ2_XXS", 999, T.IQ2_XXS, T.TQ1_0, None, 1.0, True])
def test_spec_rejects_unsupported(bad):
    with pytest.raises(ValueError, match="unsupported GGUF tensor type") as ei:
        gqz.spec(bad)
    # The message lists what *is* supported.
    for name in ("F32", "Q8_0", "Q6_K"):
        assert name in str(ei.value)


def test_row_bytes():
    assert gqz.row_bytes("F32", 7) == 28
    assert gqz.row_bytes("BF16", 3) == 6
    assert gqz.row_bytes("Q8_0", 576) == 18 * 34
    assert gqz.row_bytes(T.Q4_1, 576) == 18 * 20
    assert gqz.row_bytes("q4_k", 512) == 2 * 144
    assert gqz.row_bytes("Q6_K", 0) == 0
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        gqz.row_bytes("Q4_K", 576)
    with pytest.raises(ValueError, match="not a multiple"):
        gqz.row_bytes("Q4_0", 33)
    with pytest.raises(ValueError, match="non-negative"):
        gqz.row_bytes("Q8_0", -32)


# --------------------------------------------------------------------------
# (a) gguf-py quantizer output
# --------------------------------------------------------------------------


def test_gguf_quantizable_probe():
    # gguf-py can quantize at least the plain float and legacy 32-block types;
    # if this ever shrinks, test (a) would silently lose coverage.
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        assert name in GGUF_QUANTIZABLE


@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_matches_gguf_on_gguf_quantized_data(name, scale):
    s = gqz.QTYPES[name]
    bs = s.block_size if s.block_size > 1 else 32
    rng = np.random.default_rng([ALL_TYPES.index(name), int(scale * 1000)])  # deterministic
    for shape in [(bs,), (5, 2 * bs), (3, 4, 3 * bs), (64, 8 * bs)]:
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        x[..., :bs] += scale  # some blocks with a non-zero mean (Q4_1/Q5_1 min)
        if len(shape) > 1:
            x[0] = 0.0  # all-zero blocks: d == 0 path
        q = np.asarray(gq.quantize(x, T[name]))
        ref = gguf_ref(q, name, shape)
        ours = gqz.dequantize(q, name, shape)
        assert_matches(ours, ref)
        # And the round trip really approximates the input: the error is
        # bounded by a few quantization steps of each block's range.
        step = {"Q4_0": 1 / 7, "Q4_1": 1 / 15, "Q5_0": 1 / 15, "Q5_1": 1 / 31, "Q8_0": 1 / 127}
        rel = step.get(name, 1 / 128)  # F16/BF16: 8 mantissa bits or better
        blocks = x.reshape(-1, bs)
        span = np.abs(blocks).max(axis=1, keepdims=True) * 2
        assert (np.abs(ours.reshape(-1, bs) - blocks) <= span * rel + 1e-7).all()


# --------------------------------------------------------------------------
# (b) random-but-valid raw blocks, every type
# --------------------------------------------------------------------------


def random_raw(name: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float):
    """Random bytes for ``shape`` with finite fp16 scale fields."""
    n = int(np.prod(shape))
    if name == "F32":
        return (rng.standard_normal(n) * scale).astype(np.float32).view(np.uint8)
    if name == "F16":
        return (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8)
    if name == "BF16":
        f = (rng.standard_normal(n) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    s = gqz.QTYPES[name]
    nb = n // s.block_size
    blocks = rng.integers(0, 256, size=(nb, s.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        d = (rng.uniform(-1, 1, nb) * scale).astype(np.float16)
        d[::7] = 0  # exercise zero scales too
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_matches_gguf_on_random_valid_blocks(name):
    s = gqz.QTYPES[name]
    bs = max(s.block_size, 32)
    rng = np.random.default_rng(int(s.ggml_type) + 1234)
    # Scales keep k-quant magnitudes <= ~100 (d * 63 * 31 for Q4_K-style).
    # The (300, 4*bs) case spans several internal chunks, the last partial.
    for shape, scale in [((bs,), 1.0), ((3, 2 * bs), 0.05), ((2, 3, bs), 1e-3), ((300, 4 * bs), 0.05)]:
        raw = random_raw(name, shape, rng, scale)
        ref = gguf_ref(raw, name, shape)
        # Also hand the bytes over as [rows, row_bytes], as GGUFReader does.
        raw2d = raw.reshape(-1, gqz.row_bytes(name, shape[-1]))
        for r in (raw, raw2d):
            ours = gqz.dequantize(r, name, shape)
            assert ours.flags.c_contiguous
            assert not np.shares_memory(ours, r)
            assert_matches(ours, ref)


@pytest.mark.parametrize("name", [n for n in ALL_TYPES if n in FP16_FIELDS])
def test_matches_literal_scalar_port_of_ggml(name):
    s = gqz.QTYPES[name]
    rng = np.random.default_rng(int(s.ggml_type) + 99)
    raw = random_raw(name, (3 * s.block_size,), rng, 0.05)
    ref = []
    for blk in raw.reshape(3, s.type_size):
        ref += scalar_block(name, blk.tobytes())
    assert len(ref) == 3 * s.block_size
    assert_matches(gqz.dequantize(raw, name, (3 * s.block_size,)), np.array(ref))


def test_known_values():
    # Q8_0 block: d = 0.5, q = -128..-97 -> x = q / 2.
    blk = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8),
                          np.arange(-128, -96, dtype=np.int8).view(np.uint8)])  # fmt: skip
    np.testing.assert_array_equal(gqz.dequantize(blk, "Q8_0", (32,)), np.arange(-128, -96) / 2)
    # Q4_1 block: d = 2, m = -1, nibbles j (low) and 15 - j (high).
    lo = np.arange(16, dtype=np.uint8)
    qs = lo | ((15 - lo) << 4)
    blk = np.concatenate([np.array([2, -1], dtype=np.float16).view(np.uint8), qs])
    n = lo.astype(np.float32)
    expect = np.concatenate([n * 2 - 1, (15 - n) * 2 - 1])
    np.testing.assert_array_equal(gqz.dequantize(blk, "Q4_1", (1, 32)), expect.reshape(1, 32))
    # BF16 bit patterns.
    bits = np.array([0x3F80, 0xC000, 0x0000, 0x4049], dtype=np.uint16)
    out = gqz.dequantize(bits.view(np.uint8), "BF16", (2, 2))
    np.testing.assert_array_equal(out, np.array([[1.0, -2.0], [0.0, 3.140625]], np.float32))


def test_typed_float_inputs():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    out = gqz.dequantize(x, "F32", (4, 6))
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(gqz.dequantize(h.reshape(-1), "F16", (4, 6)), h.astype(np.float32))
    np.testing.assert_array_equal(
        gqz.dequantize(h.view(np.uint8), "f16", (24,)), h.astype(np.float32).reshape(-1)
    )
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(
        gqz.dequantize(bf, "BF16", (4, 6)), (bf.astype(np.uint32) << 16).view(np.float32)
    )
    # Raw bytes objects are accepted too.
    np.testing.assert_array_equal(gqz.dequantize(x.tobytes(), "F32", (24,)), x.reshape(-1))


def test_empty_tensor():
    out = gqz.dequantize(np.zeros(0, np.uint8), "Q4_K", (0, 256))
    assert out.shape == (0, 256) and out.dtype == np.float32


# --------------------------------------------------------------------------
# Error paths
# --------------------------------------------------------------------------


def test_dequantize_errors():
    raw = np.zeros(gqz.row_bytes("Q4_0", 64), np.uint8)
    with pytest.raises(ValueError, match="unsupported GGUF tensor type"):
        gqz.dequantize(raw, "IQ2_XXS", (64,))
    with pytest.raises(ValueError, match=r"needs 36 bytes, got 35"):
        gqz.dequantize(raw[:-1], "Q4_0", (64,))
    with pytest.raises(ValueError, match=r"needs 72 bytes, got 36"):
        gqz.dequantize(raw, "Q4_0", (2, 64))
    with pytest.raises(ValueError, match="not a multiple of the Q4_0 block size 32"):
        gqz.dequantize(raw, "Q4_0", (2, 48))
    with pytest.raises(ValueError, match="not a multiple of the Q6_K block size 256"):
        gqz.dequantize(np.zeros(210, np.uint8), "Q6_K", (2, 128))
    with pytest.raises(ValueError, match="uint8 byte array"):
        gqz.dequantize(np.zeros(9, np.float32), "Q4_0", (32,))
    with pytest.raises(ValueError, match="uint8 or float16"):
        gqz.dequantize(np.zeros(4, np.float32), "F16", (4,))
    with pytest.raises(ValueError, match="has 5 elements"):
        gqz.dequantize(np.zeros(5, np.float32), "F32", (4,))
    with pytest.raises(ValueError, match="negative"):
        gqz.dequantize(raw, "Q4_0", (-1, 64))
    with pytest.raises(TypeError, match="numpy array"):
        gqz.dequantize([0] * 36, "Q4_0", (64,))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# (c) the real SmolLM2 GGUF
# --------------------------------------------------------------------------


def test_real_gguf_tensors(smollm_path):
    reader = gguf.GGUFReader(smollm_path)
    tensors = list(reader.tensors[:10])
    if all(t.name != "token_embd.weight" for t in tensors):
        tensors += [t for t in reader.tensors if t.name == "token_embd.weight"]
    seen = set()
    for t in tensors:
        seen.add(T(t.tensor_type).name)
        shape = tuple(int(x) for x in reversed(t.shape))  # ne[] -> row-major
        ours = gqz.dequantize(t.data, t.tensor_type, shape)
        ref = np.asarray(gq.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert_matches(ours, ref.reshape(shape))
        assert np.abs(ours).max() > 0
        # HF [out, in] layout: the embedding is [vocab, hidden] and the MLP
        # down projection [hidden, intermediate].
        expected_shape = {"token_embd.weight": (49152, 576), "blk.0.ffn_down.weight": (576, 1536)}
        if t.name in expected_shape:
            assert ours.shape == expected_shape[t.name]
    assert {"Q4_1", "Q8_0", "F32"} <= seen
