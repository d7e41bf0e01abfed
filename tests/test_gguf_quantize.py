"""Our fp32 -> GGUF quantizers against gguf-py's (the types it quantizes) and ggml's own C reference quantizers
compiled from llama.cpp's source, byte for byte, on rows that take every path: random, all-zero and constant
blocks, outliers, one-signed blocks, heavy tails, tiny magnitudes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ir.formats.gguf_quantize import QUANTIZABLE, quantize
from ir.formats.gguf_quants import dequantize
from tests import ggml_quant_ref

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _rows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((40, 512)).astype(np.float32)
    x[0] = 0  # all-zero blocks
    x[1] = 0.5  # constant positive blocks
    x[2, :256] = -3.0  # a constant negative super-block beside a random one
    x[3, 5], x[3, 300] = 100.0, -250.0  # outliers
    x[4] *= 1e-6  # tiny magnitudes
    x[5, ::7] = 0  # scattered zeros
    x[6] = np.abs(x[6])  # one-signed
    x[7] = -np.abs(x[7])
    x[8:16] = rng.standard_t(1.5, (8, 512)) * 0.02  # heavy tails, weight-like scale
    x[16:20] = np.round(x[16:20] * 4) / 4  # many ties on the quant grid
    x[20, :32] = 0  # one zero legacy block in a random row
    return x


@pytest.fixture(scope="module")
def ggml_ref(tmp_path_factory):
    lib, why = ggml_quant_ref.build(tmp_path_factory.mktemp("ggml_quants"))
    if lib is None:
        pytest.skip(why)
    return lib


@pytest.mark.parametrize("kind", LEGACY)
def test_matches_gguf_py(kind):
    x = _rows()
    ours = quantize(x, kind)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("kind", QUANTIZABLE)
def test_matches_ggml_reference(kind, ggml_ref):
    x = _rows(1)
    ours, theirs = quantize(x, kind), ggml_quant_ref.quantize(ggml_ref, x, kind)
    bad = np.nonzero((ours != theirs).any(axis=1))[0]
    assert bad.size == 0, f"{kind}: rows {bad.tolist()} differ from ggml's quantize_row_*_ref"


# Relative RMS error of standard-normal rows through each type, about 1.2x what these rows measure (Q4_0 0.086,
# Q4_1 0.078, Q5_0 0.042, Q5_1 0.038, Q8_0 0.0053, Q2_K 0.295, Q3_K 0.151, Q4_K 0.072, Q5_K 0.036, Q6_K 0.017): a
# wrong scale, zero point or nibble order lands far above.
_RMS = {"Q4_0": 0.10, "Q4_1": 0.095, "Q5_0": 0.05, "Q5_1": 0.046, "Q8_0": 0.0065,
        "Q2_K": 0.35, "Q3_K": 0.18, "Q4_K": 0.086, "Q5_K": 0.044, "Q6_K": 0.021}


@pytest.mark.parametrize("kind", QUANTIZABLE)
def test_round_trip_error(kind):
    x = np.random.default_rng(2).standard_normal((8, 1024)).astype(np.float32)
    back = dequantize(quantize(x, kind), kind, x.shape)
    rel = np.sqrt(np.mean((back - x) ** 2)) / np.sqrt(np.mean(x ** 2))
    assert rel < _RMS[kind], f"{kind}: relative RMS error {rel:.4f}"


def test_rejects_partial_blocks_and_unknown_types():
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        quantize(np.zeros((2, 96), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="no quantizer for BF16"):
        quantize(np.zeros((2, 64), np.float32), "BF16")
