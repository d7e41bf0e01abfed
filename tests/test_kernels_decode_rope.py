"""The decode that rotates q and writes this step's keys and values itself (kernels_src/paged_decode_rope.py, through
paged_attention.paged_decode's `rope`): bit for bit what rope_kv_write then paged_decode give, the output and
both caches, on both interpreters; and within tolerance of the numpy references. The cache slot each step writes
is poisoned (NaN) before the launch: a program that read its key before the write would give NaN. Cases: GQA over
many split-K partitions, with an empty padded row (slot -1), a one-key context and a context ending on a block's
first slot; partial rotary in the interleaved (GLM) style with the fused reduce; MHA in one partition, fp16; each with
the first key tile read before the PDL wait and without (paged_decode_rope.PREFETCH)."""

from __future__ import annotations

import os
import re
import zlib

import numpy as np
import pytest
from test_kernels_attention import paged_cache
from test_kernels_basic import HAS_TRITON, TARGETS, _sig, dev, host

from kernels_src import paged_attention as pa
from kernels_src import paged_decode_rope as pdr
from kernels_src.rope_kv_write import rope_kv_write, rope_kv_write_ref

CASES = {  # hq, hkv, d, half (rotary pairs), interleaved, block size, contexts, partition, block_n, fused, dtype
    "gqa_split": (8, 2, 32, 16, False, 8, [100, 1, 37, 0, 17], 16, 16, False, np.float32),
    "partial_interleaved_fused": (4, 2, 32, 8, True, 8, [70, 5, 16], 16, 16, True, np.float32),
    "mha_one_partition_f16": (4, 4, 16, 8, False, 16, [30, 2], 512, 16, False, np.float16),
}


def _step(case, rng):
    """(q, k, v, caches with each step's slot poisoned, tables, contexts, slots, rows, cos, sin, settings)."""
    hq, hkv, d, half, inter, bs, lens, partition, block_n, fused, dt = CASES[case]
    kc, vc, tables = paged_cache(rng, lens, hkv, d, bs, dt)
    tables[tables < 0] = 0  # an empty context reads nothing, but its table stays in range
    ctx = np.array(lens, np.int32)
    last = np.maximum(ctx - 1, 0)
    slots = np.where(ctx > 0, tables[np.arange(len(ctx)), last // bs] * bs + last % bs, -1).astype(np.int32)
    for cache in (kc, vc):
        cache.reshape(-1, hkv, d)[slots[slots >= 0]] = np.nan  # written by the step
    q, k, v = (rng.standard_normal((len(ctx), h, d)).astype(dt) for h in (hq, hkv, hkv))
    angles = np.arange(256)[:, None] * (0.5 ** np.arange(half))[None, :]
    cos, sin = np.cos(angles).astype(dt), np.sin(angles).astype(dt)
    kw = dict(partition=partition, block_n=block_n, fused=fused, max_context=int(ctx.max()))
    return q, k, v, kc, vc, tables, ctx, slots, last.astype(np.int32), cos, sin, inter, kw


@pytest.mark.parametrize("prefetch", ["1", "0"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_rope_decode_is_rope_kv_write_then_decode(target, case, prefetch, monkeypatch):
    """With the first key tile read before the write (PREFETCH, this step's key put in from registers: the poisoned
    slot would show as NaN) and without."""
    from kernels_src.dsl import Plans

    monkeypatch.setattr(pdr, "PREFETCH_ENV", prefetch)
    monkeypatch.setattr(pa, "_DECODE_PLANS", Plans())  # the plans made with the other setting
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, k, v, kc, vc, tables, ctx, slots, rows, cos, sin, inter, kw = _step(case, rng)
    d_ = lambda a: dev(a.copy(), target)  # noqa: E731
    # unfused: q rotated in place, k rotated into the cache with v, then the decode
    qu, kcu, vcu = d_(q), d_(kc), d_(vc)
    rope_kv_write(qu, d_(k), d_(v), kcu, vcu, d_(slots), d_(rows), d_(cos), d_(sin), interleaved=inter,
                  target=target)
    want = host(pa.paged_decode(qu, kcu, vcu, d_(tables), d_(ctx), 0.3, target=target, **kw))
    # fused: one launch, q left as it was
    qf, kcf, vcf = d_(q), d_(kc), d_(vc)
    got = host(pa.paged_decode(qf, kcf, vcf, d_(tables), d_(ctx), 0.3, target=target, **kw,
                               rope=(d_(k), d_(v), d_(slots), d_(rows), d_(cos), d_(sin), inter)))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(host(kcf), host(kcu))  # NaN where neither wrote, equal elsewhere
    np.testing.assert_array_equal(host(vcf), host(vcu))
    np.testing.assert_array_equal(host(qf), q)
    # and the references': the caches rope_kv_write_ref leaves, the decode over them in fp32
    kcr, vcr = kc.astype(np.float32), vc.astype(np.float32)
    qr = rope_kv_write_ref(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), kcr, vcr, slots, rows,
                           cos.astype(np.float32), sin.astype(np.float32), interleaved=inter)
    live = ctx > 0
    ref = np.zeros(q.shape, np.float32)
    ref[live] = pa.paged_decode_ref(qr[live], kcr, vcr, tables[live], ctx[live], 0.3)
    tol = 2e-5 if q.dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=tol, atol=tol)


def test_rope_decode_refuses_what_it_cannot_do():
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, tables, ctx, slots, rows, cos, sin, inter, kw = _step("gqa_split", rng)
    rope = (k, v, slots, rows, cos, sin, inter)
    with pytest.raises(ValueError, match="needs a barrier over global memory"):
        pa.paged_decode(q, kc, vc, tables, ctx, 0.3, target="c", **{**kw, "fused": False}, rope=rope)
    with pytest.raises(ValueError, match="v \\(5, 2, 32\\): want \\[T, H, D\\], v like k"):
        pa.paged_decode(q, kc, vc, tables, ctx, 0.3, target="numpy", **kw, rope=(k[:, :1], *rope[1:]))
    with pytest.raises(ValueError, match="5 tokens but 5 slots and 2 positions"):
        pa.paged_decode(q, kc, vc, tables, ctx, 0.3, target="numpy", **kw, rope=(*rope[:3], rows[:2], *rope[4:]))
    with pytest.raises(ValueError, match="float caches only"):
        pdr.check_rope(q, k, v, np.zeros(kc.shape, np.int8), vc, slots, rows, cos, sin)


LLAMA = dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BS=16, PARTITION=64, SPLIT=True,
             SOFTCAP=False, HALF=64, INTERLEAVED=False, PDL=True)  # batch 1 at 4k: 64 partitions
AOT = {
    "llama_split": (pdr.paged_decode_rope_kernel, LLAMA),
    "phi3_fused": (pdr.paged_decode_rope_fused_kernel, LLAMA | dict(GROUP=1, HEAD_DIM=96, HALF=48, BLOCK_P=32)),
    "glm_partial_unsplit": (pdr.paged_decode_rope_kernel, LLAMA | dict(SPLIT=False, HALF=32, INTERLEAVED=True)),
    "llama_split_prefetch": (pdr.paged_decode_rope_kernel, LLAMA | dict(PREFETCH=True)),
    "phi3_fused_prefetch": (pdr.paged_decode_rope_fused_kernel,
                            LLAMA | dict(GROUP=1, HEAD_DIM=96, HALF=48, BLOCK_P=32, PREFETCH=True)),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", list(AOT))
def test_aot_sm90(name, tmp_path, monkeypatch):
    """The sm_90 builds: the cache stores, then a bar.sync, before the loop's first load of the cache; no spills;
    at most 128 registers (4 programs an SM, decode_table.WAVES: the plain decode's 96-104). PREFETCH: the first
    tile's loads of the cache are issued before the PDL wait."""
    from test_kernels_decode_fused import _cuobjdump
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn, consts = AOT[name]
    ptrs = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "out": "*bf16",
            "block_tables": "*i32", "context_lens": "*i32", "counters": "*i32", "slots": "*i32", "rows": "*i32",
            "cos": "*fp32", "sin": "*fp32"} | dict.fromkeys(("part_m", "part_l", "part_acc"), "*fp32")
    k = dsl_compile(fn, "triton", **consts).trace(signature=_sig(fn, ptrs, floats=("scale", "softcap")))
    compiled = aot_compile(k, arch=90, aligned=True)
    lines = [ln.strip() for ln in compiled.asm["ptx"].splitlines()]
    # the key's and the value's stores (the kernel's first two), a bar.sync, and only then the loop's cp.async
    # loads of the cache (the v row's own load sits between the two stores)
    kv = [i for i, ln in enumerate(lines) if "st.global" in ln][:2]
    bar = next(i for i, ln in enumerate(lines) if i > kv[1] and ln.startswith("bar.sync"))
    first_copy = next(i for i, ln in enumerate(lines) if i > kv[0] and "cp.async" in ln)
    assert kv[1] < bar < first_copy, (kv, bar, first_copy)
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    early = [ln for ln in lines[:wait] if "ld.global.v4" in ln]  # (predicated: "@%p1 ld.global.v4.b32 ...")
    assert (len(early) >= 8) == bool(consts.get("PREFETCH")), early  # K and V rows 16 bytes a load, or none
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
    regs = int(re.search(r"REG:(\d+)", _cuobjdump(compiled.asm["cubin"], tmp_path, "--dump-resource-usage"))[1])
    assert regs <= (208 if consts.get("PREFETCH") else 128), regs  # (prefetching: grids of few programs only)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["gqa_split", "partial_interleaved_fused"])
def test_on_the_gpu(case):
    """The compiled kernels against the two-launch form on the GPU, fp32 and bf16: the same expressions, so equal up to
    how ptxas contracts the rotation's multiply-adds (one fp32 rounding of the rotated values)."""
    import torch

    def g(a):
        return torch.from_numpy(a).cuda()

    for dt in (torch.float32, torch.bfloat16):
        rng = np.random.default_rng(zlib.crc32(case.encode()))
        q, k, v, kc, vc, tables, ctx, slots, rows, cos, sin, inter, kw = _step(case, rng)

        def f(a, dt=dt):
            return g(a).to(dt)
        qu, kcu, vcu = f(q), f(kc), f(vc)
        rope_kv_write(qu, f(k), f(v), kcu, vcu, g(slots), g(rows), g(cos), g(sin), interleaved=inter,
                      target="triton")
        want = pa.paged_decode(qu, kcu, vcu, g(tables), g(ctx), 0.3, target="triton", **kw)
        qf, kcf, vcf = f(q), f(kc), f(vc)
        got = pa.paged_decode(qf, kcf, vcf, g(tables), g(ctx), 0.3, target="triton", **kw,
                              rope=(f(k), f(v), g(slots), g(rows), g(cos), g(sin), inter))
        torch.cuda.synchronize()
        tol = 1e-5 if dt == torch.float32 else 2e-2
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(kcf, kcu, rtol=tol, atol=tol, equal_nan=True)
        assert torch.equal(vcf.isnan(), vcu.isnan()) and torch.equal(vcf.nan_to_num(), vcu.nan_to_num())
        assert torch.equal(qf, f(q))


def test_prefetch_takes_grids_two_programs_an_sm_hold(monkeypatch):
    """The first tile comes ahead (192 registers on sm_90, two programs an SM) only where two programs an SM hold the
    whole grid: batch 1 of 8 KV heads at a short context, not batch 1 at 4k (64 partitions) nor batch 16 at 16k;
    LLM_ENGINE_DECODE_PREFETCH=0 / 1 overrides the rule."""
    monkeypatch.setattr(pdr, "PREFETCH_ENV", "")
    assert pdr.prefetch_for(1 * 8 * 4, 132) and pdr.prefetch_for(264, 132)
    assert not pdr.prefetch_for(1 * 8 * 64, 132) and not pdr.prefetch_for(16 * 8 * 8, 132)
    monkeypatch.setattr(pdr, "PREFETCH_ENV", "0")
    assert not pdr.prefetch_for(8, 132)
    monkeypatch.setattr(pdr, "PREFETCH_ENV", "1")
    assert pdr.prefetch_for(16 * 8 * 8, 132)
