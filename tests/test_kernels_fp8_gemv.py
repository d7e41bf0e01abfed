"""The FP8 GEMV (kernels_src/fp8_gemv.py) on the DSL's interpreter and Triton's: all 256 e4m3 codes against torch's
float8_e4m3fn (NaN codes: 480, documented), the GEMV against ir/formats/fp8_blocks' dequantizer and a float64 matmul
for groups of 16, 128 and a whole row, 1/3/8 rows, odd N, several programs' tiles; planted bugs (exponent bias,
sign, the next group's scale) fail the same check; the SIMT lowering through the DSL's CPU oracle; an sm_90 AOT build
without spills."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from test_kernels_basic import TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot

from ir.formats import fp8_blocks
from kernels_src import fp8_gemv as fg
from kernels_src.dsl import launch
from kernels_src.registry import REGISTRY

NAN_CODES = (0x7F, 0xFF)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def weights(rng, n: int, k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Random finite e4m3 codes [n, k] (every sign, exponent and mantissa) and f32 scales [n, k / group]."""
    codes = rng.integers(0, 256, (n, k)).astype(np.uint8)
    codes[np.isin(codes, NAN_CODES)] = 0x38  # 1.0
    return codes, rng.uniform(0.5, 2.0, (n, k // group)).astype(np.float32)


def gemv(target, x, codes, scales, **tiles) -> np.ndarray:
    out = dev(np.full((x.shape[0], codes.shape[0]), np.nan, np.float32), target)
    fg.fp8_gemv(dev(x, target), dev(codes, target), dev(scales, target), out=out, target=target, **tiles)
    return host(out)


def check_gemv(y, x, codes, scales, group: int) -> None:
    """y against x @ W.T in float64, W from fp8_blocks' own layout and dequantizer (independent of the kernel)."""
    n, k = codes.shape
    w = fp8_blocks.dequantize(fp8_blocks.pack(codes, scales, group), (n, k), group).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("target", TARGETS)
def test_every_code_decodes_as_torch(target):
    """Row r holds code r once (zeros elsewhere), x picks that input: y[r] is the kernel's decoding of r exactly."""
    codes = np.zeros((256, 16), np.uint8)
    codes[:, 5] = np.arange(256)
    x = np.zeros((1, 16), np.float32)
    x[0, 5] = 1.0
    got = gemv(target, x, codes, np.ones((256, 1), np.float32))[0]
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = ~np.isin(np.arange(256), NAN_CODES)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(want[~finite]).all()
    np.testing.assert_array_equal(got[~finite], [480.0, -480.0])  # documented: checkpoints never hold NaN codes


SHAPES = [(16, 64), (128, 256), (96, 96)]  # (group, K): the smallest group, DeepSeek's block, one scale a row


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_dequantized_matmul(target, group, k, m, rng):
    n = 7  # odd: the last program of 2 or 4 rows (3 and 8 x rows) has rows past N
    codes, scales = weights(rng, n, k, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    check_gemv(gemv(target, x, codes, scales), x, codes, scales, group)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tiles", [dict(block_k=32, rows=3), dict(block_k=16, rows=1, num_warps=1)])
def test_gemv_tiles_across_groups(target, tiles, rng):
    """Steps smaller than a group (a group's scale read by several steps, K 80 past the last full step) and rows a
    program that do not divide N."""
    n, k, group = 11, 160, 32
    codes, scales = weights(rng, n, k, group)
    x = rng.standard_normal((2, k)).astype(np.float32)
    check_gemv(gemv(target, x, codes, scales, **tiles), x, codes, scales, group)


_decode = fg.e4m3_as_f32


def _wrong_bias(c, cvt=False):
    return _decode(c, cvt) * 0.5  # exponent bias 8


def _no_sign(c, cvt=False):
    return _decode(c & 0x7F, cvt)


PLANTED = {
    "exponent bias 8": lambda mp, s: (mp.setattr(fg, "e4m3_as_f32", _wrong_bias), s)[1],
    "sign bit dropped": lambda mp, s: (mp.setattr(fg, "e4m3_as_f32", _no_sign), s)[1],
    "the next group's scale": lambda mp, s: np.ascontiguousarray(np.roll(s, -1, axis=1)),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_fails_the_check(bug, rng, monkeypatch):
    monkeypatch.setattr(launch, "_kernels", {})  # traced afresh with the bug, forgotten after
    monkeypatch.setattr(launch, "_compiled", {})
    group, k = 16, 64
    codes, scales = weights(rng, 5, k, group)
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = gemv("numpy", x, codes, PLANTED[bug](monkeypatch, scales))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_gemv(y, x, codes, scales, group)


def test_simt_oracle(rng):
    """The SIMT lowering (CUDA C's and Metal's form) through the DSL's CPU oracle."""
    codes, scales = weights(rng, 5, 128, 32)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    check_gemv(gemv("simt-cpu", x, codes, scales), x, codes, scales, 32)


def test_bad_shapes_are_named():
    codes, scales = weights(np.random.default_rng(0), 3, 64, 16)
    with pytest.raises(ValueError, match=r"are not W \[N, 96\]"):
        fg.fp8_gemv(np.zeros((1, 96), np.float32), codes, scales)
    with pytest.raises(ValueError, match="1-8 rows"):
        fg.fp8_gemv(np.zeros((9, 64), np.float32), codes, scales)
    with pytest.raises(ValueError, match="multiple of 16"):
        fg.fp8_gemv(np.zeros((1, 48), np.float32), codes[:, :48].copy(), scales[:, :2].copy())  # groups of 24


@needs_aot
@pytest.mark.parametrize("consts", [dict(M=1), dict(M=8, ROWS=4, GROUP=16, EVEN_K=False)])
def test_aot_sm90(consts, tmp_path, monkeypatch):
    """The bench's configuration and 8 rows (the most registers) build for sm_90 with the 16-byte alignment the JIT
    specializes on: a lane's 16 codes in one load, nothing spilled."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = aot_compile(REGISTRY["fp8_gemv"].trace(**consts), arch=90, num_warps=4, aligned=True)
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert "ld.global.v4.b32" in compiled.asm["ptx"]  # a lane's 16 codes in one load
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
