"""The integer-group GEMV and dequantization (kernels_src/int_group_gemv.py) on random valid blocks, on the DSL's
interpreter and Triton's: the GEMV against x @ W.T with W from the numpy dequantizer, the dequantization bit for bit
in fp32 (its products are the reference's) and rounded once in fp16; widths 4 and 8, groups of 32 to a whole row
(not a power of two of words too; odd numbers of groups: 8-byte vectors), 1-8 rows, several steps, W off 8-byte
boundaries and in strided rows, outputs poisoned with NaN first; planted bugs (nibble order, a neighbour's group, no
bias) that the tolerance must catch; Triton AOT builds for sm_90 with 16-byte loads and no spills; the SIMT lowering
through the DSL's CPU oracle; backends.cuda.int_group_linear's paths by rows."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot

from ir.formats import int_groups
from kernels_src import int_group_gemv as ig
from kernels_src.registry import REGISTRY


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def blocks(rng, n: int, k: int, bits: int, group: int) -> np.ndarray:
    q = rng.integers(0, 1 << bits, (n, k))
    scales = rng.uniform(0.5, 2.0, (n, k // group)).astype(np.float16).astype(np.float32) / k
    return int_groups.pack(q, scales, rng.integers(0, 1 << bits, (n, k // group)), bits, group)


SHAPES = [(4, 32, 96), (4, 128, 256), (8, 32, 64), (4, 96, 192), (8, 256, 256)]  # (bits, group, K)


def _gemv(x, w, bits, group, target, **tiles):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, np.float32), target)
    ig.int_group_gemv(dev(x, target), dev(w, target), bits, group, out=out, target=target, **tiles)
    return host(out)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_reference(target, bits, group, k, m, rng):
    w = blocks(rng, 7, k, bits, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    _close(_gemv(x, w, bits, group, target), ig.int_group_gemv_ref(x, w, bits, group))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k,lanes,rows", [(4, 128, 1024, 4, 3), (4, 64, 320, 8, 2), (8, 32, 224, 8, 1)])
def test_gemv_over_several_steps(target, bits, group, k, lanes, rows, rng):
    """Few vectors a step, so that a row takes several (the last one past the row's end), and rows a program that
    do not divide N; 16-byte vectors (K = 1024: eight groups) and 8-byte ones (five and seven groups)."""
    w = blocks(rng, 7, k, bits, group)
    x = rng.standard_normal((2, k)).astype(np.float32)
    _close(_gemv(x, w, bits, group, target, lanes=lanes, rows=rows), ig.int_group_gemv_ref(x, w, bits, group))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("int8_x", [False, True])
def test_gemv_on_odd_placements(target, int8_x, rng):
    """W 4 bytes past an 8-byte boundary (the launcher copies it: headers are 8-byte loads), and W's words as rows of
    a wider buffer (a stride 2 mod 4 words: 8-byte vectors)."""
    k, group = 256, 64
    w = blocks(rng, 5, k, 4, group)
    x = rng.standard_normal((2, k)).astype(np.float32)
    want = ig.int_group_gemv_ref(x, w, 4, group)
    shifted = np.zeros(w.size + 12, np.uint8)
    start = 4 + (-shifted.__array_interface__["data"][0]) % 8
    shifted = shifted[start:start + w.size].reshape(w.shape)
    shifted[:] = w
    wide = np.zeros((5, w.shape[1] // 4 + 2), np.int32)
    wide[:, :-2] = w.view(np.int32)
    for placed in (shifted, wide[:, :-2]):
        got = _gemv(x, placed, 4, group, target, int8_x=int8_x)
        if int8_x:  # against the same path on W as packed (test_kernels_int_group_i8 checks that one)
            np.testing.assert_allclose(got, ig.int_group_gemv(x, w, 4, group, int8_x=True), rtol=1e-6, atol=1e-6)
        else:
            _close(got, want)


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 activations need torch")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k", [(4, 128, 256), (4, 32, 96), (8, 64, 128)])
def test_gemv_bf16_x(target, bits, group, k, rng):
    """bf16 x, read as 64-bit (4 bits) or 32-bit (8 bits) words of values, 16-byte and 8-byte vectors of W; y in
    fp32 at the fp32 tolerance (bf16 values are exact in fp32)."""
    import torch

    w = blocks(rng, 6, k, bits, group)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32)).bfloat16()
    out = torch.full((3, 6), float("nan"))
    ig.int_group_gemv(x, torch.from_numpy(w), bits, group, out=out, target=target)  # both interpreters take torch
    _close(out.numpy(), ig.int_group_gemv_ref(x.float().numpy(), w, bits, group))


def _planted(w, bits: int, group: int, k: int, bug: str) -> np.ndarray:
    """W [N, K] decoded with one bug a kernel could have: nibbles (bytes at 8 bits) of each pair swapped, each group
    read with its neighbour's scale and bias, or no bias."""
    n = w.shape[0]
    qbytes, scales, biases = int_groups.split(w, bits, group, n, k)
    q = int_groups.unpack_q(qbytes, bits).reshape(n, -1, 2)[..., ::-1] if bug == "order" else None
    q = (q.reshape(n, k) if q is not None else int_groups.unpack_q(qbytes, bits)).astype(np.float32)
    if bug == "group":
        scales, biases = np.roll(scales, 1, axis=1), np.roll(biases, 1, axis=1)
    if bug == "bias":
        biases = np.zeros_like(biases)
    return (q.reshape(n, -1, group) * scales[..., None] + biases[..., None]).reshape(n, k)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
def test_the_tolerance_catches_planted_bugs(target, bits, rng):
    """The kernel matches the reference within _close's tolerance, and each planted bug's result lies outside it:
    a kernel with that bug would fail these tests."""
    k, group = 256, 64
    w = blocks(rng, 5, k, bits, group)
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = _gemv(x, w, bits, group, target)
    _close(got, ig.int_group_gemv_ref(x, w, bits, group))
    for bug in ("order", "group", "bias"):
        with pytest.raises(AssertionError):
            _close(got, x @ _planted(w, bits, group, k, bug).T)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k", SHAPES[:3])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dequantize_matches_reference(target, bits, group, k, dtype, rng):
    n = 5
    w = blocks(rng, n, k, bits, group)
    out = dev(np.full((n, k), np.nan, dtype), target)
    ig.int_group_dequantize(dev(w, target), bits, group, k, out=out, target=target)
    np.testing.assert_array_equal(host(out), int_groups.dequantize(w, (n, k), bits, group).astype(dtype))


@pytest.mark.parametrize("bits,group,k,m", [(4, 128, 256, 3), (8, 96, 192, 1)])
def test_simt_oracle(bits, group, k, m, rng):
    """The SIMT lowering (Metal's and CUDA C's form) through the DSL's CPU oracle: the GEMV and the dequantization."""
    n = 6
    w = blocks(rng, n, k, bits, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.full((m, n), np.nan, np.float32)
    ig.int_group_gemv(x, w, bits, group, out=y, target="simt-cpu")
    want = ig.int_group_gemv_ref(x, w, bits, group)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    out = np.full((n, k), np.nan, np.float32)
    ig.int_group_dequantize(w, bits, group, k, out=out, target="simt-cpu")
    np.testing.assert_array_equal(out, int_groups.dequantize(w, (n, k), bits, group))


def test_bad_shapes_are_named():
    w = blocks(np.random.default_rng(0), 3, 64, 4, 32)
    with pytest.raises(ValueError, match=r"do not hold \[3, 96\]"):
        ig.int_group_gemv(np.zeros((1, 96), np.float32), w, 4, 32)
    with pytest.raises(ValueError, match="1-8 rows"):
        ig.int_group_gemv(np.zeros((9, 64), np.float32), w, 4, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        ig.int_group_dequantize(w, 4, 48, 64)


@needs_aot
@pytest.mark.parametrize("name,consts,n", [
    ("int_group_gemv", dict(M=1), 14336), ("int_group_gemv", dict(M=2), 4096),
    ("int_group_gemv", dict(M=8, BITS=8), 14336), ("int_group_gemv", dict(M=8, VEC=2), 14336),
    ("int_group_dequantize", {}, 0)])
def test_aot_sm90(name, consts, n, tmp_path, monkeypatch):
    """Builds at the launcher's tiles for N (4096: two vectors a lane) with the JIT's 16-byte specialization; the
    GEMV reads W and x in 16-byte vectors (every row's W and x's words: ld.global.v4) and its headers in 8-byte
    words, and nothing spills."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    gemv = name == "int_group_gemv"
    tiles = ig.default_tiles(consts.get("M", 1), n) if gemv else {}
    nw = tiles.pop("num_warps", 4)
    k = REGISTRY[name].trace(**consts, **tiles)
    compiled = aot_compile(k, arch=90, num_warps=nw, aligned=gemv)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
    if gemv:
        rows, vec4 = tiles["ROWS"], consts.get("VEC", 4) == 4
        assert ptx.count("ld.global.v4.b32") + ptx.count("ld.global.v2.b64") >= rows * vec4 + consts["M"]
        assert ptx.count("ld.global.v2.b32") >= rows * (not vec4) and ptx.count("ld.global.b64") >= rows
        assert "griddepcontrol.wait" in ptx


def _linear(x, w, bits, group, chunk_bytes, perm=None):
    torch = pytest.importorskip("torch")
    from backends.cuda.int_group_linear import int_group_linear
    from ir.weight_formats import int_group_format

    n, k = w.shape[0], x.shape[1]
    return int_group_linear(torch.from_numpy(x), torch.from_numpy(w), int_group_format(bits, group).name, (n, k),
                            perm, "triton-interpret", chunk_bytes).numpy()


def test_linear_past_the_gemm_in_chunks(rng):
    """backends.cuda.int_group_linear past the GEMM's rows: W dequantized a few rows at a time for the GEMM
    (torch_ops.dequantized_matmul: 13 rows in chunks of 4, and in one) against x @ W.T of the numpy dequantizer."""
    from backends.cuda.int_group_linear import GEMM_ROWS

    n, k, bits, group = 13, 128, 4, 32
    w = blocks(rng, n, k, bits, group)
    x = rng.standard_normal((GEMM_ROWS + 3, k)).astype(np.float32)
    want = x @ int_groups.dequantize(w, (n, k), bits, group).T
    for chunk_rows in (4, n):
        got = _linear(x, w, bits, group, chunk_rows * k * 4)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("m", [ig.MAX_ROWS + 1, 64])
def test_linear_rows_through_the_gemm(m, rng, monkeypatch):
    """9 to GEMM_ROWS (128) rows (act order's gather first) go through int_group_gemm's kernel and nothing else."""
    torch = pytest.importorskip("torch")
    from backends.cuda import int_group_linear as igl

    calls = []
    for fn in ("int_group_gemv", "int_group_matmul", "int_group_dequantize"):
        real = getattr(igl, fn)
        monkeypatch.setattr(igl, fn, lambda *a, _f=fn, _r=real, **kw: calls.append(_f) or _r(*a, **kw))
    n, k, bits, group = 11, 64, 8, 32
    w = blocks(rng, n, k, bits, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    perm = rng.permutation(k)
    got = _linear(x, w, bits, group, 1 << 20, torch.from_numpy(perm))
    want = x[:, perm] @ int_groups.dequantize(w, (n, k), bits, group).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    assert calls == ["int_group_matmul"]
