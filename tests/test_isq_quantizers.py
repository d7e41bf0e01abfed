"""The quantizers behind `--isq int4` and `--isq fp8` against independent references: the e4m3 encoder against
torch's float8_e4m3fn cast on every interesting value, the 128x128 block quantizer against DeepSeek-V3's recipe
written here in torch, and 4-bit RTN against a re-derivation in torch of GPTQ's asymmetric quantizer and its
error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ir.formats import fp8_blocks, int_groups
from ir.isq import quantize_values


def _torch_e4m3(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _interesting() -> np.ndarray:
    """Every finite e4m3 value, each midpoint between neighbours (ties: to even) and one f32 ulp either side of it,
    subnormals and what rounds into or out of them, 448 and up to 464 (ties to 448), +-0, and a log-uniform spread."""
    vals = fp8_blocks.E4M3[np.isfinite(fp8_blocks.E4M3)]
    pos = np.unique(np.abs(vals))
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))
    edges = np.array([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -6 - 2.0 ** -10, 1e-30, 1e-45, 449, 463.9, 464,
                      0.0, -0.0], np.float32)
    rng = np.random.default_rng(0)
    spread = np.exp(rng.uniform(-20, np.log(464), 20000)) * rng.choice([-1, 1], 20000)
    x = np.concatenate([vals, mids, up, down, edges, spread]).astype(np.float32)
    return np.concatenate([x, -x])


def test_e4m3_encoding_is_torchs_cast():
    x = _interesting()
    np.testing.assert_array_equal(fp8_blocks.encode(x), _torch_e4m3(x))
    assert fp8_blocks.encode(np.float32(2.0 ** -10)) == 0  # a tie between 0 and the least subnormal: to even
    assert fp8_blocks.encode(np.float32(-0.0)) == 0x80 and fp8_blocks.encode(np.float32(448)) == 0x7E


def test_e4m3_saturates_and_refuses_non_finite():
    """Beyond 464 torch's cast makes NaN; we saturate to +-448. NaN and infinities are refused."""
    big = np.array([465, 1000, 3.4e38, -500], np.float32)
    np.testing.assert_array_equal(fp8_blocks.encode(big), _torch_e4m3(np.clip(big, -448, 448)))
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="NaN or infinite values have no e4m3 code"):
            fp8_blocks.encode(np.array([1.0, bad], np.float32))


@pytest.mark.parametrize("shape", [(256, 384), (200, 96)])  # (200, 96): partial edge blocks, groups of 32
def test_fp8_blockwise_is_deepseeks_recipe(shape):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, (shape[0], 1)))).astype(np.float32)
    w[:128, :96] = 0  # an all-zero block
    blocks, group = fp8_blocks.quantize_blockwise(w, (128, 128))
    assert group == np.gcd(shape[1], 128)
    # DeepSeek-V3's recipe in torch: per 128x128 block s = amax / 448, codes = float8_e4m3fn(w / s).
    t = torch.from_numpy(w)
    n, k = shape
    s = torch.ones(-(-n // 128), -(-k // 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = t[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
            if amax > 0:
                s[i, j] = amax / 448
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    want = (t / full).to(torch.float8_e4m3fn)
    codes, scales = fp8_blocks.split(blocks, group, n, k)
    np.testing.assert_array_equal(codes, want.view(torch.uint8).numpy())
    np.testing.assert_array_equal(scales, full[:, ::group].numpy())
    back = fp8_blocks.dequantize(blocks, shape, group)
    np.testing.assert_array_equal(back, (want.float() * full).numpy())
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value (2**-10 * scale among the subnormals).
    assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) / 16, 2.0 ** -10 * full.numpy()) * (1 + 1e-6))


def _gptq_rtn(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's Quantizer (bits 4, sym False, per group) re-derived in torch: (q, scale, zero) per group."""
    x = w.reshape(w.shape[0], -1, group)
    xmin = torch.clamp(x.amin(-1), max=0)
    xmax = torch.clamp(x.amax(-1), min=0)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(both_zero, -1.0, xmin), torch.where(both_zero, 1.0, xmax)
    scale = ((xmax - xmin) / 15).half().float()  # checkpoints store fp16 scales
    zero = torch.round(-xmin / scale)
    q = torch.clamp(torch.round(x / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(w.shape), scale, zero


@pytest.mark.parametrize("group", [128, 32])
def test_int4_rtn_is_gptqs_quantizer(group):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((48, 256)) * np.exp(rng.uniform(-2, 2, (48, 1)))).astype(np.float32)
    w[0, :group] = 0  # an all-zero group
    w[1, :group] = np.abs(w[1, :group]) + 0.5  # a group above zero: its range still takes in 0
    blocks = int_groups.quantize_rtn(w, 4, group)
    q, scale, zero = _gptq_rtn(torch.from_numpy(w), group)
    qbytes, scales, biases = int_groups.split(blocks, 4, group, *w.shape)
    np.testing.assert_array_equal(int_groups.unpack_q(qbytes, 4), q.numpy().astype(np.uint8))
    np.testing.assert_array_equal(scales, scale.numpy())
    np.testing.assert_array_equal(biases, (-zero * scale).numpy())
    back = int_groups.dequantize(blocks, w.shape, 4, group)
    ref = ((q.reshape(48, -1, group) - zero[..., None]) * scale[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(back, ref.numpy())  # q * s - z * s is exact with fp16 scales
    # Rounding to nearest: at most half a step from each weight (the fp16 scale may shrink the range by 2**-11).
    step = np.repeat(scales, group, axis=1)
    assert np.all(np.abs(back - w) <= step * (0.5 + 15 * 2.0 ** -11))
    assert (np.abs(back - w) / step).max() > 0.45  # and the bound is not loose


@pytest.mark.parametrize("kind", ["I4_G128", "F8E4M3_G32"])
def test_isq_slabs_are_the_whole_matrix(kind):
    """--isq quantizes large matrices in slabs of rows on threads (whole 128-row blocks for fp8, each matrix of a
    stack on its own): the bytes are the one-call quantizer's, with partial edge blocks."""
    w = np.random.default_rng(3).standard_normal((2, 2100, 224)).astype(np.float32)
    if kind.startswith("I4"):
        w = w[..., :128]
        want = int_groups.quantize_rtn(w.reshape(-1, 128), 4, 128)
    else:
        want = np.concatenate([fp8_blocks.quantize_blockwise(m)[0] for m in w])
    np.testing.assert_array_equal(quantize_values(w, kind), want)
