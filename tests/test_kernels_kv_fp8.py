"""The FP8 (e4m3) KV cache's kernels: the DSL's e4m3 codec bit for bit against torch's float8_e4m3fn (every finite
value, every midpoint and its neighbours, subnormals, 448 and beyond, NaN), the quantizing write against its numpy
reference (codes and scales exact, the reference against a re-derivation in torch), and the paged decode (split-K)
and prefill kernels over e4m3 codes against the reference attention run on the dequantized cache (fp32: exact to
rounding); planted wrong scales fail. DSL interpreter and Triton's interpreter; sm_90 AOT builds."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from test_isq_quantizers import _interesting
from test_kernels_attention import paged_cache
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_kv_int8 import aot_sm90, check_prefill

from kernels_src import e4m3, kv_fp8
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import tl

TOL = dict(rtol=1e-5, atol=1e-5)
NAN_CODES = (0x7F, 0xFF)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def encode_kernel(x, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, e4m3.encode(tl.load(x + i, mask=i < n, other=0.0)).to(tl.uint8), mask=i < n)


def decode_kernel(codes, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out + i, e4m3.decode_f32(tl.load(codes + i)) * e4m3.FP16_SHIFT)


def torch_e4m3(x: np.ndarray) -> np.ndarray:
    """torch's float8_e4m3fn bytes of x saturated to +-448 (torch's cast alone makes NaN from 464)."""
    t = torch.from_numpy(np.asarray(x, np.float32))
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


@pytest.mark.parametrize("target", TARGETS)
def test_codec_is_torchs(target):
    """Encoding: round to nearest even, +-448 beyond (infinities too), NaN to 0x7F / 0xFF (sign kept) as torch's
    cast. Decoding: every finite code exactly; NaN codes read 480 (documented: written only with a NaN scale)."""
    x = np.concatenate([_interesting(), np.array([465, 1e4, 3.4e38, np.inf, np.nan], np.float32)])
    x = np.concatenate([x, -x])
    out = dev(np.zeros(x.shape, np.uint8), target)
    dsl_compile(encode_kernel, target, BLOCK=4096)[tl.cdiv(len(x), 4096)](dev(x, target), out, len(x))
    np.testing.assert_array_equal(host(out), torch_e4m3(x))
    assert host(out)[-1] == 0xFF and host(out)[len(x) // 2 - 1] == 0x7F  # -NaN, NaN

    got = dev(np.full(256, np.nan, np.float32), target)
    dsl_compile(decode_kernel, target, BLOCK=256)[1](dev(np.arange(256, dtype=np.uint8), target), got)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = ~np.isin(np.arange(256), NAN_CODES)
    np.testing.assert_array_equal(host(got)[finite], want[finite])
    np.testing.assert_array_equal(host(got)[list(NAN_CODES)], [480.0, -480.0])


def test_reference_is_torchs_recipe(rng):
    """quantize_ref against the recipe written in torch: scale = amax / 448 per vector, codes = e4m3(x * 448 / amax);
    every value back within half an e4m3 step of its own magnitude (2^-4 of it; 2^-10 scales among subnormals)."""
    x = (rng.standard_normal((5, 3, 48)) * np.exp(rng.uniform(-6, 6, (5, 3, 1)))).astype(np.float32)
    x[1, 2] = 0
    x[0, 0, 7] = 300 * np.abs(x[0, 0]).max()  # an outlier: the other values' relative error stays 2^-4
    codes, scales = kv_fp8.quantize_ref(x)
    t = torch.from_numpy(x)
    amax = t.abs().amax(-1)
    inv = 448 / amax.clamp_min(kv_fp8.TINY)
    np.testing.assert_array_equal(codes, (t * inv[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
                                  .view(torch.uint8).numpy())
    np.testing.assert_array_equal(scales, (amax / 448).numpy())
    back = kv_fp8.dequantize_ref(codes, scales)
    assert (np.abs(back - x) <= np.abs(x) / 16 + scales[..., None] * 2.0 ** -10 + 1e-30).all()
    assert (codes[1, 2] == 0).all() and scales[1, 2] == 0


@pytest.mark.parametrize("target", TARGETS)
def test_kv_write_fp8(target, rng):
    t, h, d, bs, nb = 6, 3, 48, 4, 4  # d 48: a head dim that is not a power of two
    k = rng.standard_normal((t, 2 * h, d)).astype(np.float16)[:, :h]  # strided heads, as out of a qkv split
    v = (rng.standard_normal((t, h, d)) * 3).astype(np.float16)
    k[0, 1] = 0  # an all-zero head: scale 0, codes 0
    v[2, 0, 5] = 40  # an outlier sets its own head's scale
    v[3, 2, 9] = np.nan  # NaN: that token and head read NaN
    slots = np.array([3, -1, 9, 0, 14, -1], np.int64)
    caches = [np.full((nb, bs, h, d), 0x55, np.uint8) for _ in range(2)]
    scales = [np.full((nb, bs, h), -7, np.float32) for _ in range(2)]
    want = [a.copy() for a in caches + scales]
    kv_fp8.kv_write_fp8_ref(k, v, *want, slots)
    got = [dev(a, target) for a in caches + scales]
    kv_fp8.kv_write_fp8(dev(k, target), dev(v, target), *got, dev(slots, target), target=target)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(host(g), w)  # written slots exact (NaN where NaN), the rest untouched
    assert want[3][2, 1, 0] == np.float32(40 / 448)  # slot 9: token 2's v, head 0
    assert (want[0][0, 3, 1] == 0).all() and want[2][0, 3, 1] == 0
    assert np.isnan(want[3][0, 0, 2]) and want[1][0, 0, 2, 9] == 0x7F  # slot 0: token 3's v, head 2
    assert np.isnan(kv_fp8.dequantize_ref(want[1][0, 0, 2], want[3][0, 0, 2])).all()


def _fp8_cache(rng, ctx, hkv, d, bs):
    """An fp8 paged cache (codes, scales, codes, scales) of random contexts, and its block tables."""
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, np.float32)
    kc[:, :, :, :8] *= 20  # outlier channels, as SmolLM2's keys
    out = []
    for c in (kc, vc):
        out += kv_fp8.quantize_ref(np.nan_to_num(c))
    return out, tables


DECODE = {"gqa_split": (8, 2, 64, 8, [1, 37, 70], 32, None), "one_part_softcap": (4, 4, 48, 4, [5, 19], 512, 5.0)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(DECODE))
def test_paged_decode_fp8(target, case, rng):
    hq, hkv, d, bs, ctx, partition, softcap = DECODE[case]
    (kc, ks, vc, vs), tables = _fp8_cache(rng, ctx, hkv, d, bs)
    ctx = np.array(ctx, np.int32)
    q = rng.standard_normal((len(ctx), hq, d)).astype(np.float32)

    def run(k_scales, v_scales):
        out = dev(np.full(q.shape, np.nan, np.float32), target)
        pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target), 0.3,
                        softcap=softcap, out=out, partition=partition, block_n=16, k_scales=dev(k_scales, target),
                        v_scales=dev(v_scales, target), target=target)
        return host(out)

    deq = kv_fp8.dequantize_ref
    want = pa.paged_decode_ref(q, deq(kc, ks), deq(vc, vs), tables, ctx, 0.3, softcap=softcap)
    np.testing.assert_allclose(run(ks, vs), want, **TOL)
    wrong = ks.copy()
    wrong[:, 1::4] *= 1.5  # one token in four's keys a little off
    assert not np.allclose(run(wrong, vs), want, **TOL)
    assert not np.allclose(run(ks, np.ascontiguousarray(np.roll(vs, 1, axis=2))), want, **TOL)  # heads' scales


@pytest.mark.parametrize("target", TARGETS)
def test_paged_prefill_fp8(target, rng):
    def plant(vs):
        wrong = vs.copy()
        wrong[:, ::3] *= 1.5  # one token in three's values a little off
        return wrong

    check_prefill(target, rng, _fp8_cache, kv_fp8.dequantize_ref, plant)


def test_fp16_queries_on_the_interpreter(rng):
    """fp16 q: the decoded tiles take q's dtype (exact: e4m3 over 2^8 is an fp16 value) before the dots."""
    (kc, ks, vc, vs), tables = _fp8_cache(rng, [13, 30], 2, 32, 8)
    ctx = np.array([13, 30], np.int32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float16)
    got = pa.paged_decode(q, kc, vc, tables, ctx, 0.25, partition=16, block_n=16, k_scales=ks, v_scales=vs)
    want = pa.paged_decode_ref(q.astype(np.float32), kv_fp8.dequantize_ref(kc, ks), kv_fp8.dequantize_ref(vc, vs),
                               tables, ctx, 0.25)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_fp8_cache_refusals():
    codes = np.zeros((2, 4, 1, 32), np.uint8)
    with pytest.raises(ValueError, match="want uint8 e4m3 codes and float32 scales"):
        kv_fp8.check_scales(codes, codes, np.zeros((2, 4, 1, 1), np.float32), np.zeros((2, 4, 1), np.float32))
    with pytest.raises(ValueError, match="must be contiguous"):
        kv_fp8.check_scales(codes, codes, *(np.zeros((2, 4, 2), np.float32)[:, :, :1] for _ in range(2)))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", ["write", "decode", "prefill"])
def test_aot_sm90_fp8(name, tmp_path, monkeypatch):
    kernels = (kv_fp8.kv_write_fp8_kernel, pa.paged_decode_fp8_kernel, pp.paged_prefill_fp8_kernel)
    aot_sm90(name, kernels, dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, PDL=True), "*u8", tmp_path, monkeypatch)
