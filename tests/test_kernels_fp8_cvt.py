"""The DSL's FP8 type (tl.float8e4nv) and the kernels that decode e4m3 by its conversion (FP8_CVT): every byte
converts as torch's float8_e4m3fn on both interpreters; the fp8 KV cache's decode and prefill and fp8_gemv give the
integer decode's outputs bit for bit and stay within their references; what the type refuses, and targets without
FP8 refuse it by name; sm_90 AOT builds show the cvt, fewer loop instructions and no spills."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from test_kernels_basic import HAS_TRITON, TARGETS, _sig, dev, host
from test_kernels_fp8_gemv import check_gemv
from test_kernels_fp8_gemv import weights as gemv_weights
from test_kernels_kv_fp8 import _fp8_cache

from kernels_src import e4m3, kv_fp8
from kernels_src import fp8_gemv as fg
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp
from kernels_src.dsl import TraceError, tl
from kernels_src.dsl import compile as dsl_compile

NAN_CODES = (0x7F, 0xFF)
FINITE = ~np.isin(np.arange(256), NAN_CODES)
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32 attention over 70 keys; a wrong scale is off by far more


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def cvt_on(monkeypatch):
    """cvt(target, on): make the kernels built for `target` decode by the FP8 conversion (on) or integer ops."""
    return lambda target, on: monkeypatch.setattr(e4m3, "CVT_TARGETS", (target,) if on else ())


def convert_kernel(codes, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(codes + i).to(tl.float8e4nv, bitcast=True).to(out.dtype.element_ty))


def both_decodes_kernel(codes, out, BLOCK: tl.constexpr):
    """Row 0: decode_f16 by the cvt; row 1: by integer ops, times 2^8 (exact)."""
    i = tl.arange(0, BLOCK)
    c = tl.load(codes + i)
    tl.store(out + i, e4m3.decode_f16(c, cvt=True))
    tl.store(out + BLOCK + i, e4m3.decode_f16(c) * e4m3.FP16_SHIFT)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_byte_converts_as_torch(target, dtype):
    if target == "numpy" and dtype == torch.bfloat16:
        pytest.skip("numpy has no bf16 arrays (the interpreter holds bf16 as rounded fp32: the fp32 case)")
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.full((256,), 7.0, dtype=dtype)
    args = (codes.numpy(), out.numpy()) if target == "numpy" else (codes, out)  # numpy: views of the tensors
    dsl_compile(convert_kernel, target, BLOCK=256)[1](*args)
    got, want = out.float().numpy(), codes.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(got[FINITE], want[FINITE])
    if target == "numpy":  # the format's NaN codes, as the hardware's cvt (Triton's interpreter reads them finite)
        assert np.isnan(got[list(NAN_CODES)]).all()


@pytest.mark.parametrize("target", TARGETS)
def test_cvt_decode_is_the_integer_decode(target):
    out = dev(np.zeros(512, np.float16), target)
    dsl_compile(both_decodes_kernel, target, BLOCK=256)[1](dev(np.arange(256, dtype=np.uint8), target), out)
    cvt, ints = host(out).reshape(2, 256)
    np.testing.assert_array_equal(cvt.view(np.uint16)[FINITE], ints.view(np.uint16)[FINITE])  # -0 included


def _refused(body):
    def kernel(codes, out):
        body(tl.load(codes).to(tl.float8e4nv, bitcast=True), out)
    return kernel


@pytest.mark.parametrize("body,message", [
    (lambda f, out: tl.store(out, (f + f).to(tl.float32)), "fp8 tiles only convert"),
    (lambda f, out: tl.store(out, tl.abs(f).to(tl.float32)), "fp8 tiles only convert"),
    (lambda f, out: tl.store(out, f.to(tl.int32).to(tl.float32)), "convert to fp16, bf16 or fp32"),
    (lambda f, out: tl.store(out, f.to(tl.float32).to(tl.float8e4nv).to(tl.float32)), "e4m3.py encodes"),
    (lambda f, out: tl.store(out, f.to(tl.int16, bitcast=True).to(tl.float32)), "changes the width"),
])
def test_what_the_type_refuses(body, message):
    with pytest.raises(TraceError, match=message):
        dsl_compile(_refused(body), "numpy").trace(signature={"codes": "*u8", "out": "*fp32"})


@pytest.mark.parametrize("target", ["simt-cpu", "cuda", "metal"])
def test_targets_without_fp8_refuse_it(target):
    kern = dsl_compile(convert_kernel, target, BLOCK=32)
    with pytest.raises(ValueError, match=f"target '{target}' has no FP8 type"):
        kern.source(signature={"codes": "*u8", "out": "*fp32"})


def _decode(target, q, kc, ks, vc, vs, tables, ctx):
    out = dev(np.full(q.shape, np.nan, np.float32), target)
    pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target), 0.3,
                    out=out, partition=32, block_n=16, k_scales=dev(ks, target), v_scales=dev(vs, target),
                    target=target)
    return host(out)


def _prefill(target, q, kc, ks, vc, vs, tables, ctx, starts):
    out = pp.paged_prefill(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target),
                           dev(starts, target), 0.2, sliding_window=12, block_m=16, block_n=16,
                           k_scales=dev(ks, target), v_scales=dev(vs, target), target=target)
    return host(out)


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_cache_decode_and_prefill_by_cvt(target, rng, cvt_on):
    """The K and V tiles decoded by the cvt: the integer decode's outputs bit for bit, and the reference's."""
    ctx = np.array([5, 37, 70], np.int32)
    (kc, ks, vc, vs), tables = _fp8_cache(rng, ctx, 2, 64, 8)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    deq = kv_fp8.dequantize_ref
    qlen = np.array([5, 9, 4], np.int32)  # a whole prompt and two chunks
    starts = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    qp = rng.standard_normal((int(starts[-1]), 8, 64)).astype(np.float32)
    got = {}
    for on in (True, False):
        cvt_on(target, on)
        got[on] = (_decode(target, q, kc, ks, vc, vs, tables, ctx),
                   _prefill(target, qp, kc, ks, vc, vs, tables, ctx, starts))
    for a, b in zip(got[True], got[False], strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    np.testing.assert_allclose(got[True][0], pa.paged_decode_ref(q, deq(kc, ks), deq(vc, vs), tables, ctx, 0.3),
                               **TOL)
    np.testing.assert_allclose(got[True][1], pp.paged_prefill_ref(qp, deq(kc, ks), deq(vc, vs), tables, ctx, starts,
                                                                  0.2, sliding_window=12), **TOL)


@pytest.mark.parametrize("target", TARGETS)
def test_half_queries_by_cvt(target, rng, cvt_on):
    """fp16 q: the tiles converted straight to q's dtype (the cvt) or decoded then converted, the same bits."""
    ctx = np.array([13, 30], np.int32)
    (kc, ks, vc, vs), tables = _fp8_cache(rng, ctx, 2, 32, 8)
    q = rng.standard_normal((2, 4, 32)).astype(np.float16)
    got = {}
    for on in (True, False):
        cvt_on(target, on)
        out = dev(np.full(q.shape, np.nan, np.float16), target)
        pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target),
                        0.25, out=out, partition=16, block_n=16, k_scales=dev(ks, target), v_scales=dev(vs, target),
                        target=target)
        got[on] = host(out)
    np.testing.assert_array_equal(got[True].view(np.uint16), got[False].view(np.uint16))
    assert np.isfinite(got[True]).all()


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_gemv_by_cvt(target, rng, cvt_on):
    codes, scales = gemv_weights(rng, 7, 160, 32)
    x = rng.standard_normal((3, 160)).astype(np.float32)
    got = {}
    for on in (True, False):
        cvt_on(target, on)
        out = dev(np.full((3, 7), np.nan, np.float32), target)
        fg.fp8_gemv(dev(x, target), dev(codes, target), dev(scales, target), out=out, block_k=32, rows=2,
                    target=target)
        got[on] = host(out)
    np.testing.assert_array_equal(got[True].view(np.uint32), got[False].view(np.uint32))
    check_gemv(got[True], x, codes, scales, 32)


def test_the_flag_picks_triton_only():
    assert e4m3.use_cvt("triton") == (os.environ.get("LLM_ENGINE_FP8_CVT", "1") != "0")  # on unless set to 0
    assert not any(map(e4m3.use_cvt, ("numpy", "triton-interpret", "simt-cpu", "cuda", "metal")))


CODES = {"k_cache": "*u8", "v_cache": "*u8", "k_scales": "*fp32", "v_scales": "*fp32"}
AOT = {  # Llama's layer (bf16, 8 KV heads of 128) as the bench runs it; fp8_gemv at its default tiles
    "decode": (pa.paged_decode_fp8_kernel, dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BS=16,
                                                PARTITION=512, SPLIT=True, SOFTCAP=False, PDL=True),
               CODES | {"q": "*bf16", "out": "*bf16", "block_tables": "*i32", "context_lens": "*i32"}
               | dict.fromkeys(("part_m", "part_l", "part_acc"), "*fp32")),
    "gemv": (fg.fp8_gemv_kernel, dict(GROUP=128, M=1, ROWS=1, BLOCK_K=2048, EVEN_K=True, PDL=True),
             {"codes": "*u8", "scales": "*fp32", "x": "*bf16", "y": "*bf16"}),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", list(AOT))
def test_aot_sm90_cvt(name, tmp_path, monkeypatch):
    """sm_90: the cvt in the PTX, fewer instructions a loop step than the integer decode (decode 1,241 -> 980,
    gemv 126 -> 81 on Triton 3.7), nothing spilled."""
    from kernels_src.dsl.triton_target import aot_compile
    from tools.sass_mix import loop_mix

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn, consts, ptrs = AOT[name]
    mix = {}
    for on in (False, True):
        k = dsl_compile(fn, "triton", **consts, FP8_CVT=on).trace(signature=_sig(fn, ptrs, ("scale", "softcap")))
        c = aot_compile(k, arch=90, aligned=True)
        assert ("cvt.rn.f16x2.e4m3x2" in c.asm["ptx"]) == on
        mix[on] = loop_mix(c.asm["cubin"])
        assert mix[on].stack == 0
    if name == "decode" and e4m3.F16_DOTS:  # bf16 q, dots in fp16: the cvt alone, no F2F an element to bf16
        assert mix[True].opcodes["F2F"] == 0 and mix[True].instructions < 900, mix[True].summary()  # 980 in bf16
    assert mix[True].instructions < 0.9 * mix[False].instructions, (mix[True].summary(), mix[False].summary())


@pytest.mark.parametrize("stages", [None, 1])
def test_decode_stages_switch(stages, rng, monkeypatch):
    """LLM_ENGINE_FP8_DECODE_STAGES (e4m3.DECODE_STAGES): the fp8 cache's decode kernel, decoded by the cvt, built at
    that pipelining depth; the 16-bit cache's and the integer decode's at Triton's default."""
    ctx = np.array([5, 37], np.int32)
    (kc, ks, vc, vs), tables = _fp8_cache(rng, ctx, 2, 64, 8)
    q = torch.from_numpy(rng.standard_normal((2, 8, 64)).astype(np.float32))
    t = {k: torch.from_numpy(v) for k, v in dict(kc=kc, ks=ks, vc=vc, vs=vs, tables=tables, ctx=ctx).items()}
    monkeypatch.setattr(e4m3, "DECODE_STAGES", stages)

    def plan(cvt, fp8=True):
        monkeypatch.setattr(e4m3, "CVT_TARGETS", ("triton",) if cvt else ())
        monkeypatch.setattr(e4m3, "_gpu_converts", lambda: True)
        kc_, vc_ = (t["kc"], t["vc"]) if fp8 else (torch.zeros(kc.shape), torch.zeros(vc.shape))
        scales = (t["ks"], t["vs"]) if fp8 else (None, None)
        return pa._decode_plan(q, kc_, vc_, t["ctx"], 2, 16, 32, 0.0, None, 4, *scales, "triton", False, False,
                               None)[0][0].kernel

    assert plan(True).num_stages == stages
    assert plan(False).num_stages is None and plan(True, fp8=False).num_stages is None
