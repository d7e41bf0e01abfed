"""The int8 KV cache's kernels: the quantizing write against its numpy reference (codes and scales exact), and the
paged decode (split-K) and prefill kernels over int8 codes against the reference attention run on the dequantized
cache (fp32: exact to rounding); a planted wrong scale must fail. DSL interpreter and Triton's interpreter."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_attention import paged_cache
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from kernels_src import kv_int8
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("target", TARGETS)
def test_kv_write_int8(target, rng):
    t, h, d, bs, nb = 6, 3, 64, 4, 4
    k = rng.standard_normal((t, 2 * h, d)).astype(np.float16)[:, :h]  # strided heads, as out of a qkv split
    v = (rng.standard_normal((t, h, d)) * 3).astype(np.float16)
    k[0, 1, :32] = 0  # an all-zero group: scale 0, codes 0
    v[2, 0, 5] = 40  # an outlier widens its own group only
    slots = np.array([3, -1, 9, 0, 14, -1], np.int64)
    caches = [np.full((nb, bs, h, d), -7, np.int8) for _ in range(2)]
    scales = [np.full((nb, bs, h, d // 32), np.nan, np.float32) for _ in range(2)]
    want = [a.copy() for a in caches + scales]
    kv_int8.kv_write_int8_ref(k, v, *want, slots)
    got = [dev(a, target) for a in caches + scales]
    kv_int8.kv_write_int8(dev(k, target), dev(v, target), *got, dev(slots, target), target=target)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(host(g), w)  # written slots exact, the rest untouched
    # The reference itself: every element within half a step of its group, the zero group exact.
    back = kv_int8.dequantize_ref(want[1][2, 1], want[3][2, 1])  # slot 9 = block 2, offset 1: token 2's v
    step = want[3][2, 1]
    assert (np.abs(back - v[2].astype(np.float32)) <= np.repeat(step, 32, -1) / 2 + 1e-6).all()
    assert step[0, 0] > 4 * step[0, 1]
    assert (want[0][0, 3, 1, :32] == 0).all() and want[2][0, 3, 1, 0] == 0


def _int8_cache(rng, ctx, hkv, d, bs):
    """An int8 paged cache (codes, scales) of random contexts and its dequantized fp32 copy."""
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, np.float32)
    kc[:, :, :, :8] *= 20  # outlier channels, as SmolLM2's keys
    out = []
    for c in (kc, vc):
        codes, scales = kv_int8.quantize_ref(np.nan_to_num(c))
        out += [codes, scales]
    return out, tables


def _deq(codes, scales):
    return kv_int8.dequantize_ref(codes, scales)


DECODE = {"gqa_split": (8, 2, 64, 8, [1, 37, 70], 32), "one_part": (4, 4, 32, 4, [5, 19], 512)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(DECODE))
def test_paged_decode_int8(target, case, rng):
    hq, hkv, d, bs, ctx, partition = DECODE[case]
    (kc, ks, vc, vs), tables = _int8_cache(rng, ctx, hkv, d, bs)
    ctx = np.array(ctx, np.int32)
    q = rng.standard_normal((len(ctx), hq, d)).astype(np.float32)

    def run(k_scales):
        out = dev(np.full(q.shape, np.nan, np.float32), target)
        pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target), 0.3,
                        out=out, partition=partition, block_n=16, k_scales=dev(k_scales, target),
                        v_scales=dev(vs, target), target=target)
        return host(out)

    want = pa.paged_decode_ref(q, _deq(kc, ks), _deq(vc, vs), tables, ctx, 0.3)
    np.testing.assert_allclose(run(ks), want, **TOL)
    wrong = ks.copy()
    wrong[..., -1] *= 1.5  # one group of every key a little off
    assert not np.allclose(run(wrong), want, **TOL)


@pytest.mark.parametrize("target", TARGETS)
def test_paged_prefill_int8(target, rng):
    def plant(vs):
        wrong = vs.copy()
        wrong[..., 0] *= 1.5
        return wrong

    check_prefill(target, rng, _int8_cache, _deq, plant)


def check_prefill(target, rng, make_cache, dequantize, plant) -> None:
    """paged_prefill over an 8-bit cache (make_cache: (codes, scales, codes, scales), tables) against the reference
    on its dequantized copy, a whole prompt and a chunk, under a window; `plant`'s wrong value scales must fail."""
    hq, hkv, d, bs = 4, 2, 64, 4
    ctx, qlen = np.array([9, 21], np.int32), np.array([9, 6], np.int32)  # a whole prompt, a chunk after 15 tokens
    (kc, ks, vc, vs), tables = make_cache(rng, ctx, hkv, d, bs)
    starts = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    q = rng.standard_normal((int(starts[-1]), hq, d)).astype(np.float32)

    def run(v_scales):
        out = pp.paged_prefill(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target),
                               dev(ctx, target), dev(starts, target), 0.2, sliding_window=12, block_m=16, block_n=16,
                               k_scales=dev(ks, target), v_scales=dev(v_scales, target), target=target)
        return host(out)

    want = pp.paged_prefill_ref(q, dequantize(kc, ks), dequantize(vc, vs), tables, ctx, starts, 0.2,
                                sliding_window=12)
    np.testing.assert_allclose(run(vs), want, **TOL)
    assert not np.allclose(run(plant(vs)), want, **TOL)


def test_int8_cache_refusals():
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_int8.scales_shape((4, 16, 2, 48))
    codes = np.zeros((2, 4, 1, 32), np.int8)
    with pytest.raises(ValueError, match="float32 scales"):
        kv_int8.check_scales(codes, codes, np.zeros((2, 4, 1, 2), np.float32), np.zeros((2, 4, 1, 1), np.float32))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", ["write", "decode", "prefill"])
def test_aot_sm90_int8(name, tmp_path, monkeypatch):
    kernels = (kv_int8.kv_write_int8_kernel, pa.paged_decode_int8_kernel, pp.paged_prefill_int8_kernel)
    aot_sm90(name, kernels, dict(GROUPS=4, BLOCK_H=8, BLOCK_G=4, PDL=True), "*i8", tmp_path, monkeypatch)


def aot_sm90(name: str, kernels: tuple, write_consts: dict, code: str, tmp_path, monkeypatch, **consts_over):
    """An 8-bit cache's write, decode or prefill kernel (of `kernels`, in that order) built for sm_90 at Llama's
    layer (bf16 q, 8 KV heads of 128, codes of pointer type `code`; `consts_over` replaces or adds constexprs) as the
    JIT specializes the runner's tensors: the build, checked to spill nothing, returned."""
    from test_kernels_basic import _sig
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    codes = {"k_cache": code, "v_cache": code, "k_scales": "*fp32", "v_scales": "*fp32"}
    att = codes | {"q": "*bf16", "out": "*bf16", "block_tables": "*i32", "context_lens": "*i32"}
    fn, consts, ptrs = {
        "write": (kernels[0], write_consts, codes | {"k": "*bf16", "v": "*bf16", "slots": "*i64"}),
        "decode": (kernels[1], dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BS=16,
                                    PARTITION=512, SPLIT=True, SOFTCAP=False, PDL=True),
                   att | dict.fromkeys(("part_m", "part_l", "part_acc"), "*fp32")),
        "prefill": (kernels[2], dict(GROUP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_D=128, BLOCK_N=64, BS=16,
                                     SOFTCAP=False, PDL=True), att | {"query_start": "*i32"}),
    }[name]
    k = dsl_compile(fn, "triton", **consts | consts_over).trace(signature=_sig(fn, ptrs, floats=("scale", "softcap")))
    compiled = aot_compile(k, arch=90, aligned=True)
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
    return compiled
