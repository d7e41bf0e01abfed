"""The DSL's FP8 dot and the FP8 GEMM (kernels_src/fp8_gemm.py) on the DSL's interpreter and Triton's: an e4m3 x e4m3
dot is the float64 product of torch's float8_e4m3fn values; x's per-row, per-group quantization is an independent
numpy encoder's bit for bit; the GEMM matches the float64 product of those codes tightly and the dequantized product
within what x's e4m3 rounding explains (~2.6% of the norm), which a wrong block scale, the scale grid transposed or a
block of W transposed breaks; what the dot refuses; sm_90 builds on FP8 wgmma without spills."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from test_kernels_basic import TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot

from ir.formats import fp8_blocks
from kernels_src import fp8_gemm as fg
from kernels_src.dsl import TraceError, tl
from kernels_src.dsl import compile as dsl_compile
from kernels_src.registry import REGISTRY

ROUNDING = 0.04  # x's e4m3 rounding: ~0.026 of the product's norm on these inputs; a wrong scale gives 0.3 and up


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def fp8_codes(rng, shape) -> np.ndarray:
    """Random finite e4m3 bytes (every sign, exponent and mantissa; NaN codes replaced by 1.0)."""
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    return codes


def dot_kernel(a, b, out, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """out [M, N] = a [M, K] @ b [N, K].T over e4m3 bytes."""
    k = tl.arange(0, K)[None, :]
    av = tl.load(a + tl.arange(0, M)[:, None] * K + k).to(tl.float8e4nv, bitcast=True)
    bv = tl.load(b + tl.arange(0, N)[:, None] * K + k).to(tl.float8e4nv, bitcast=True)
    tl.store(out + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], tl.dot(av, tl.trans(bv)))


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_dot_is_the_product_of_torchs_values(target, rng):
    a, b = fp8_codes(rng, (32, 64)), fp8_codes(rng, (16, 64))
    out = dev(np.full((32, 16), np.nan, np.float32), target)
    dsl_compile(dot_kernel, target, M=32, N=16, K=64)[1](dev(a, target), dev(b, target), out)
    val = [torch.from_numpy(c).view(torch.float8_e4m3fn).double().numpy() for c in (a, b)]
    want = val[0] @ val[1].T
    np.testing.assert_allclose(host(out), want, rtol=0, atol=1e-6 * np.abs(want).max())


def _dot_of(a_type, b_type, k: int):
    def kernel(a, b, out):
        i = tl.arange(0, 16)[:, None] * k + tl.arange(0, k)[None, :]
        av, bv = (tl.load(p + i).to(t, bitcast=t == tl.float8e4nv) for p, t in ((a, a_type), (b, b_type)))
        tl.store(out + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :], tl.dot(av, tl.trans(bv)))
    return kernel


@pytest.mark.parametrize("b_type,k,message", [(tl.float8e4nv, 16, "needs K >= 32"),
                                              (tl.float16, 32, "takes two fp8e4nv tiles")])
def test_what_the_fp8_dot_refuses(b_type, k, message):
    with pytest.raises(TraceError, match=message):
        kern = dsl_compile(_dot_of(tl.float8e4nv, b_type, k), "numpy")
        kern.trace(signature={"a": "*u8", "b": "*u8", "out": "*fp32"})


@pytest.mark.parametrize("target", ["simt-cpu", "cuda", "metal"])
def test_targets_without_fp8_refuse_the_gemm(target):
    kern = dsl_compile(fg.fp8_gemm_kernel, target, **REGISTRY["fp8_gemm"].constexprs)
    with pytest.raises(ValueError, match=f"target '{target}' has no FP8 type"):
        kern.source(signature=REGISTRY["fp8_gemm"].signature)


def activations(rng, m: int, k: int) -> np.ndarray:
    """Rows of different magnitudes, one of them zero (its groups' scale floor)."""
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30, (m, 1))).astype(np.float32)
    x[min(2, m - 1)] = 0.0
    return x


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group,k", [(128, 384), (96, 288)])  # 3 groups (a program's 4 masked); group off a power of 2
def test_quantize_x_is_the_reference(target, group, k, rng):
    x = activations(rng, 5, k)
    xq, xs = fg.quantize_x(dev(x, target), group, target=target)
    want_q, want_s = fg.quantize_x_ref(x, group)
    np.testing.assert_array_equal(host(xq), want_q)
    np.testing.assert_array_equal(host(xs), want_s)
    torch_q = (torch.from_numpy(x).view(5, -1, group) / torch.from_numpy(want_s)[..., None]).to(torch.float8_e4m3fn)
    np.testing.assert_array_equal(want_q, torch_q.view(torch.uint8).view(5, k).numpy())  # the encoder is torch's cast


def gemm(target, x, codes, scales, **tiles) -> np.ndarray:
    out = dev(np.full((x.shape[0], codes.shape[0]), np.nan, np.float32), target)
    fg.fp8_matmul(dev(x, target), dev(codes, target), dev(scales, target), out=out, target=target, **tiles)
    return host(out)


def check_gemm(y, x, codes, scales) -> None:
    """Tight against fp8_matmul_ref (x quantized as the kernel does), then check_dense."""
    want = fg.fp8_matmul_ref(x, codes, scales)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())
    check_dense(y, x, codes, scales)


def check_dense(y, x, codes, scales) -> None:
    """Within ROUNDING of the norm of x @ W.T, W dequantized by fp8_blocks' own layout (x unquantized)."""
    n, k = codes.shape
    group = k // scales.shape[1]
    w = fp8_blocks.dequantize(fp8_blocks.pack(codes, scales, group), (n, k), group).astype(np.float64)
    dense = x.astype(np.float64) @ w.T
    rel = np.linalg.norm(y - dense) / np.linalg.norm(dense)
    assert rel <= ROUNDING, f"{rel:.3f} of the dequantized product's norm off"


CASES = {  # (m, n, k, group, tiles)
    "m9_swap": (9, 70, 256, 128, {}),  # 16-row tile, W's rows past N clamped
    "m20_split": (20, 33, 384, 64, dict(split_k=2)),  # 6 steps over two splits, fp32 partials reduced
    "m70_wide": (70, 40, 256, 128, {}),  # 64 x 256 tiles of x @ W.T: two row tiles, N far inside one
    "m17_g256_noswap": (17, 64, 512, 256, dict(swap=False)),  # two steps a scale
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_gemm_matches_references(target, case, rng):
    m, n, k, group, tiles = CASES[case]
    codes, scales = fp8_codes(rng, (n, k)), rng.uniform(0.5, 2.0, (n, k // group)).astype(np.float32)
    x = activations(rng, m, k)
    check_gemm(gemm(target, x, codes, scales, **tiles), x, codes, scales)


def _transpose_scale_grid(s):  # the [2, 2] grid of 128 x 128 blocks' scales read transposed
    grid = s[::128].T
    return np.ascontiguousarray(grid[np.arange(s.shape[0]) // 128])


def _transpose_block(c):  # W's first 128 x 128 block transposed
    c = c.copy()
    c[:128, :128] = c[:128, :128].T.copy()
    return c


PLANTED = {
    "the next group's scale": (lambda c: c, lambda s: np.ascontiguousarray(np.roll(s, -1, axis=1))),
    "one block's scale doubled": (lambda c: c, lambda s: s * np.where(np.arange(s.shape[0])[:, None] < 128,
                                                                      [[2.0, 1.0]], 1.0).astype(np.float32)),
    "the scale grid transposed": (lambda c: c, _transpose_scale_grid),
    "a block of W transposed": (_transpose_block, lambda s: s),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_fails_the_check(bug, rng):
    """W of 2 x 2 blocks of 128 x 128 with one scale each (DeepSeek's layout, expanded a row): each bug fails."""
    n = k = 256
    codes = fp8_codes(rng, (n, k))
    grid = rng.uniform(0.25, 4.0, (2, 2)).astype(np.float32)
    scales = np.ascontiguousarray(grid[np.arange(n) // 128])
    x = activations(rng, 9, k)
    bad_codes, bad_scales = (f(a) for f, a in zip(PLANTED[bug], (codes, scales), strict=True))
    check_dense(gemm("numpy", x, codes, scales), x, codes, scales)
    with pytest.raises(AssertionError, match="of the dequantized product's norm off"):
        check_dense(gemm("numpy", x, bad_codes, bad_scales), x, codes, scales)


def test_bad_shapes_are_named():
    codes, scales = np.zeros((4, 64), np.uint8), np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="a multiple of 32"):
        fg.fp8_matmul(np.zeros((9, 64), np.float32), codes, scales)
    with pytest.raises(ValueError, match=r"are not W \[N, 96\]"):
        fg.fp8_matmul(np.zeros((9, 96), np.float32), codes, scales[:, :2].copy())


QUANT_SIG = {"x": "*bf16", "xq": "*u8", "xs": "*fp32"}


@needs_aot
@pytest.mark.parametrize("tiles", ["prefill", "m16", "m64", "quantize"])
def test_aot_sm90(tiles, tmp_path, monkeypatch):
    """The prefill's 64 x 256 tiles and the 16- and 64-row SWAP tiles build on sm_90's FP8 wgmma (e4m3 x e4m3 into
    f32) without spills; the quantizing kernel too."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    if tiles == "quantize":
        k = dsl_compile(fg.fp8_quantize_x_kernel, GROUP=128, BLOCK=128, GROUPS=32, PDL=True).trace(
            signature={p: QUANT_SIG.get(p, "i32") for p in dsl_compile(fg.fp8_quantize_x_kernel).runtime_params})
        compiled = aot_compile(k, arch=90, num_warps=4, aligned=True)
    else:
        cfg = dict(fg.TILES[dict(prefill=128, m16=16, m64=64)[tiles]])
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        compiled = aot_compile(REGISTRY["fp8_gemm"].trace(**cfg), arch=90, num_warps=nw, num_stages=ns, aligned=True)
        assert ".f32.e4m3.e4m3" in compiled.asm["ptx"] and "wgmma.mma_async" in compiled.asm["ptx"]
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0


def test_the_sweeps_settings_and_check(monkeypatch):
    """tools/sweep_fp8_gemm: the default tiles first, then its space; its check (the DSL's interpreter here) passes
    a split-K setting and fails a wrong scale."""
    from tools import sweep_fp8_gemm as sf
    from tools.kernel_case_base import Dev
    from tools.kernel_cases_fp8 import fp8_weights

    quick, full = sf.settings(2048, 4096, 4096, 128, True), sf.settings(2048, 4096, 4096, 128, False)
    assert full[0] == quick[0] and quick[0]["block_n"] == fg.TILES[128]["BLOCK_N"] and len(full) > 20
    monkeypatch.setattr(sf, "TARGET", "numpy")
    d = Dev(3, "cpu")
    x = d.randn((9, 256), torch.bfloat16)
    codes, scales = fp8_weights(d, 70, 256, 64)
    s = dict(block_m=16, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=2)
    assert sf.check(torch, d, x, codes, scales, s) is None
    real = fg.fp8_matmul  # planted: the kernel reads the next group's scales
    monkeypatch.setattr(fg, "fp8_matmul", lambda x, c, s, **kw: real(x, c, s.roll(-1, dims=1).contiguous(), **kw))
    assert "rel err" in sf.check(torch, d, x, codes, scales, s)
