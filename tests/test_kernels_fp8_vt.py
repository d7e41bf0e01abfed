"""The fp8 KV cache's token-minor V (kernels_src/kv_fp8.py: token_minor, V_TOKEN_MINOR): the quantizing write stores the
same codes as into a token-major V, and decode (split, whole tiles and a last partial one, a window) and prefill (a
prompt and a chunk, with and without a window) read bit for bit what they read from the token-major V, with the bytes
past each context NaN codes (the last tile's vectors load them). DSL interpreter, Triton's interpreter and (decode)
the SIMT form on the CPU; the sm_90 build's loop: V's tile in 16-byte vectors, no byte-wide shared-memory reads,
fewer instructions."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_kv_fp8 import _fp8_cache

from kernels_src import e4m3, kv_fp8
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _poisoned_tails(vc, vs, tables, ctx):
    """NaN codes and scales in every V slot past the contexts (the last blocks' tails and the unowned blocks)."""
    bs = vc.shape[1]
    owned = np.zeros(vc.shape[:2], bool)
    for b, c in enumerate(ctx):
        j = np.arange(c)
        owned[tables[b, j // bs], j % bs] = True
    vc, vs = vc.copy(), vs.copy()
    vc[~owned], vs[~owned] = 0x7F, np.nan
    return vc, vs


def _both(rng, ctx, hkv, d, bs):
    (kc, ks, vc, vs), tables = _fp8_cache(rng, ctx, hkv, d, bs)
    vc, vs = _poisoned_tails(vc, vs, tables, ctx)
    vt = kv_fp8.token_minor(vc)
    assert kv_fp8.is_token_minor(vt) and not kv_fp8.is_token_minor(vc) and np.array_equal(vt, vc)
    return kc, ks, vs, tables, {"token-major": vc, "token-minor": vt}


def _same_bits(outs):
    a, b = (host(o).view(np.uint32) for o in outs.values())
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(host(next(iter(outs.values())))).all()


DECODE = {  # hq, hkv, d, block_size, contexts, partition, block_n, window
    "split_tails": (8, 2, 32, 8, [1, 37, 70], 32, 32, None),
    "window": (4, 2, 32, 4, [23, 50], 512, 16, 13),
}


@pytest.mark.parametrize("target", [*TARGETS, "simt-cpu"])
@pytest.mark.parametrize("case", list(DECODE))
@pytest.mark.parametrize("cvt", [False, True])
@pytest.mark.skipif(bool(e4m3.MMA_TARGETS), reason="LLM_ENGINE_FP8_MMA=1: a token-minor V's decode is the FP8-MMA one "
                    "(tests/test_kernels_fp8_mma.py), not the converting loop's in another layout")
def test_decode_reads_either_layout_alike(target, case, cvt, rng, monkeypatch):
    """cvt: decoded by the FP8 conversion, where the NaN codes past a context decode to NaN (integer ops: finite; the
    SIMT targets have no FP8 type). simt-cpu: the CUDA C / Metal form of the two loops, on the CPU."""
    if cvt and target == "simt-cpu":
        pytest.skip("the SIMT targets have no FP8 type")
    monkeypatch.setattr(e4m3, "CVT_TARGETS", (target,) if cvt else ())
    hq, hkv, d, bs, ctx, partition, block_n, window = DECODE[case]
    kc, ks, vs, tables, vcs = _both(rng, ctx, hkv, d, bs)
    ctx = np.array(ctx, np.int32)
    q = rng.standard_normal((len(ctx), hq, d)).astype(np.float32)
    outs = {}
    for name, vc in vcs.items():
        out = dev(np.full(q.shape, np.nan, np.float32), target)
        pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target), 0.3,
                        sliding_window=window, out=out, partition=partition, block_n=block_n,
                        k_scales=dev(ks, target), v_scales=dev(vs, target), target=target)
        outs[name] = out
    _same_bits(outs)
    want = pa.paged_decode_ref(q, kv_fp8.dequantize_ref(kc, ks), kv_fp8.dequantize_ref(vcs["token-major"], vs),
                               tables, ctx, 0.3, sliding_window=window)
    np.testing.assert_allclose(host(outs["token-minor"]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_reads_either_layout_alike(target, window, rng, monkeypatch):
    monkeypatch.setattr(e4m3, "CVT_TARGETS", (target,))
    hq, hkv, d, bs = 4, 2, 32, 4
    ctx, qlen = np.array([9, 21], np.int32), np.array([9, 6], np.int32)  # a whole prompt, a chunk after 15 tokens
    kc, ks, vs, tables, vcs = _both(rng, ctx, hkv, d, bs)
    starts = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    q = rng.standard_normal((int(starts[-1]), hq, d)).astype(np.float32)
    outs = {name: pp.paged_prefill(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target),
                                   dev(ctx, target), dev(starts, target), 0.2, sliding_window=window, block_m=16,
                                   block_n=16, k_scales=dev(ks, target), v_scales=dev(vs, target), target=target)
            for name, vc in vcs.items()}
    _same_bits(outs)


@pytest.mark.parametrize("target", TARGETS)
def test_write_into_token_minor(target, rng):
    t, h, d, bs, nb = 6, 3, 48, 4, 4
    k, v = (rng.standard_normal((t, h, d)).astype(np.float16) for _ in range(2))
    slots = np.array([3, -1, 9, 0, 14, 7], np.int64)
    caches = {}
    for minor in (False, True):
        codes = [np.full((nb, bs, h, d), 0x55, np.uint8) for _ in range(2)]
        codes[1] = kv_fp8.token_minor(codes[1]) if minor else codes[1]
        got = [dev(a, target) for a in codes + [np.zeros((nb, bs, h), np.float32) for _ in range(2)]]
        kv_fp8.kv_write_fp8(dev(k, target), dev(v, target), *got, dev(slots, target), target=target)
        caches[minor] = [host(g) for g in got]
    assert kv_fp8.is_token_minor(caches[True][1])
    for a, b in zip(caches[False], caches[True], strict=True):
        np.testing.assert_array_equal(a, b)


def test_new_v_cache_follows_the_switch(monkeypatch):
    for on in (True, False):
        monkeypatch.setattr(kv_fp8, "V_TOKEN_MINOR", on)
        c = kv_fp8.new_v_cache((3, 16, 2, 8), lambda s: np.zeros(s, np.uint8))
        assert c.shape == (3, 16, 2, 8) and kv_fp8.is_token_minor(c) == on and not c.any()


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
def test_aot_sm90_vector_loads(tmp_path, monkeypatch):
    """Llama-3-8B's decode at the fp8 table's 128 keys a tile (cvt, fp16 dots): in the whole tiles' loop V's bytes
    come in 16-byte cp.async, and leave shared memory by ldmatrix, not a byte a load (Triton 3.7: 1,442 -> 942
    instructions, 221 -> 168 registers)."""
    import collections
    import re

    from test_kernels_fp8_cvt import AOT, _sig

    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl.triton_target import aot_compile
    from tools.sass_mix import _BRANCH, _INSTR, sass

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn, consts, ptrs = AOT["decode"]
    loops = {}
    for minor in (False, True):
        k = dsl_compile(fn, "triton", **dict(consts, BLOCK_N=128), FP8_CVT=True, V_TOKEN_MINOR=minor).trace(
            signature=_sig(fn, ptrs, ("scale", "softcap")))
        instrs = [(int(a, 16), s.strip()) for a, s in _INSTR.findall(sass(aot_compile(k, arch=90,
                                                                                      aligned=True).asm["cubin"]))]
        spans = [(int(m.group(1), 16), a) for a, s in instrs if (m := _BRANCH.search(s)) and int(m.group(1), 16) < a]
        loops[minor] = [collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split()[0] for a, s in instrs
                                            if lo <= a <= hi) for lo, hi in spans if hi - lo > 1000]
    [old], (new, tail) = loops[False], loops[True]  # token-minor: the whole tiles' loop, then the last tile's
    assert old["LDS.U8"] == 128 and new["LDS.U8"] == 0 and tail["LDS.U8"] == 0
    assert new["LDGSTS.E.BYPASS.128"] == 2 * old["LDGSTS.E.BYPASS.128"] and new["LDGSTS.E.64"] == 0
    assert sum(new.values()) < 0.75 * sum(old.values()), (sum(new.values()), sum(old.values()))
