"""The decode over an fp8 cache on FP8 tensor cores (kernels_src/paged_attend_fp8.py, LLM_ENGINE_FP8_MMA=1): against
an emulation of its algorithm written here in numpy with torch's e4m3 casts (q as two e4m3 terms a row, S^T by key
tiles, each tile's weights times the values' scales rounded to e4m3 a scale a query row, the online softmax), exact
to fp32 rounding; against the exact attention over the dequantized cache, within what those roundings cost (and a
planted wrong scale outside it); off unless asked; on sm_90, both dots on FP8 wgmma from shared memory. DSL
interpreter and Triton's interpreter."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_kv_fp8 import _fp8_cache, torch_e4m3

from kernels_src import e4m3, kv_fp8
from kernels_src import paged_attention as pa
from kernels_src.paged_attend import LOG2E


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def e4m3_values(x) -> np.ndarray:
    """x rounded to e4m3 (nearest even, saturated to +-448) by torch's float8_e4m3fn, as float32."""
    return torch.from_numpy(torch_e4m3(x)).view(torch.float8_e4m3fn).float().numpy()


def row_scaled(x):
    top = np.abs(x).max(1)
    s = np.where(top > 0, top / 448, 1.0).astype(np.float32)
    return e4m3_values(x / s[:, None]), s


def emulate(q, kc, ks, vc, vs, tables, ctx, scale, softcap, block_n, window=None):
    """The FP8-MMA decode's result, one (sequence, KV head) at a time over its key tiles (partitions change no tile:
    they are whole tiles; a window starts the tiles at its first key rounded down to a block)."""
    _, hq, _ = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    g = hq // hkv
    kval, vval = (kv_fp8.dequantize_ref(c, np.ones(ks.shape, np.float32)) for c in (kc, vc))
    out = np.zeros_like(q)
    for b, c in enumerate(int(x) for x in ctx):
        j = np.arange(c)
        blk, off = tables[b, j // bs], j % bs
        lo = 0 if window is None else max(0, (c - window) // bs * bs)
        for h in range(hkv):
            qq = q[b, h * g:(h + 1) * g].astype(np.float32)
            hi, s_hi = row_scaled(qq)
            lo8, s_lo = row_scaled(qq - hi * s_hi[:, None])
            m, den, acc = np.full(g, -1e30, np.float32), np.zeros(g, np.float32), np.zeros((q.shape[2], g), np.float32)
            for t0 in range(lo, c, block_n):
                t = np.arange(t0, min(t0 + block_n, c))
                k, v = kval[blk[t], off[t], h], vval[blk[t], off[t], h]
                s = ((k @ hi.T) * s_hi + (k @ lo8.T) * s_lo) * ks[blk[t], off[t], h][:, None]
                s = softcap * LOG2E * np.tanh(s * (scale / softcap)) if softcap else s * (scale * LOG2E)
                if window is not None:
                    s = np.where((t > c - 1 - window)[:, None], s, -np.inf)
                m_new = np.maximum(m, s.max(0))
                alpha, p = np.exp2(m - m_new), np.exp2(s - m_new)
                pv = p * vs[blk[t], off[t], h][:, None]
                top = pv.max(0)
                top = np.where(top > 1e-30, top, 1.0)
                acc = acc * alpha + (v.T @ e4m3_values(pv * (448 / top))) * (top / 448)
                den, m = den * alpha + p.sum(0), m_new
            out[b, h * g:(h + 1) * g] = (acc / den).T
    return out


CASES = {  # hq, hkv, d, block size, contexts, partition, block_n, softcap, window
    "gqa_split": (8, 2, 64, 8, [1, 37, 70, 200], 32, 32, None, None),
    "llama_layer": (32, 8, 128, 16, [300, 129], 64, 64, None, None),
    "mha_softcap": (4, 4, 32, 16, [5, 19, 64], 512, 32, 5.0, None),
    "window": (4, 2, 32, 4, [23, 50], 512, 32, None, 13),
    "phi3_heads_fused": (4, 4, 96, 16, [90, 257], 32, 32, None, None),  # D 96 in a 128 tile; the last program combines
}
FUSED = {"phi3_heads_fused"}


def run(target, case, rng, monkeypatch, plant=None):
    hq, hkv, d, bs, ctx, partition, block_n, softcap, window = CASES[case]
    (kc, ks, vc, vs), tables = _fp8_cache(rng, ctx, hkv, d, bs)
    vt = kv_fp8.token_minor(vc)
    ctx = np.array(ctx, np.int32)
    q = rng.standard_normal((len(ctx), hq, d)).astype(np.float32)
    monkeypatch.setattr(e4m3, "MMA_TARGETS", (target,))
    ks_used = plant(ks) if plant else ks
    out = dev(np.full(q.shape, np.nan, np.float32), target)
    pa.paged_decode(dev(q, target), dev(kc, target), dev(vt, target), dev(tables, target), dev(ctx, target), 0.3,
                    softcap=softcap, sliding_window=window, out=out, partition=partition, block_n=block_n,
                    k_scales=dev(ks_used, target), v_scales=dev(vs, target), target=target,
                    fused=True if case in FUSED else None)
    exact = pa.paged_decode_ref(q, kv_fp8.dequantize_ref(kc, ks), kv_fp8.dequantize_ref(vc, vs), tables, ctx, 0.3,
                                softcap=softcap, sliding_window=window)
    return host(out), emulate(q, kc, ks, vc, vs, tables, ctx, 0.3, softcap, block_n, window), exact


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_decode_is_its_emulation_and_within_its_rounding(target, case, rng, monkeypatch):
    got, emulated, exact = run(target, case, rng, monkeypatch)
    np.testing.assert_allclose(got, emulated, rtol=2e-5, atol=2e-5)
    # q keeps ~7 bits, the weights 3 (rounded to nearest: +-3%): over three seeds a case, at most 1.1-9.3% of the
    # outputs' rms, 0.06-0.28% on average (1.0-1.3% under the softcap, whose flat weights each round); a key scale
    # 1.5x off for one token in four: 48-549% and 4.7-66%
    rms = float(np.sqrt((exact ** 2).mean()))
    err = np.abs(got - exact)
    assert err.max() < 0.15 * rms and err.mean() < 0.025 * rms, (err.max() / rms, err.mean() / rms)


@pytest.mark.parametrize("target", TARGETS)
def test_a_wrong_key_scale_is_outside_the_rounding(target, rng, monkeypatch):
    def plant(ks):
        wrong = ks.copy()
        wrong[:, 1::4] *= 1.5  # one token in four's keys a little off
        return wrong

    got, _, exact = run(target, "gqa_split", rng, monkeypatch, plant)
    rms = float(np.sqrt((exact ** 2).mean()))
    assert np.abs(got - exact).max() > 0.15 * rms and np.abs(got - exact).mean() > 0.025 * rms


def test_off_unless_asked(rng):
    """Without LLM_ENGINE_FP8_MMA=1 the decode over an fp8 cache is bit for bit the converting loop's."""
    if os.environ.get("LLM_ENGINE_FP8_MMA") == "1":
        pytest.skip("asked for here")
    assert e4m3.MMA_TARGETS == () and not e4m3.use_mma("triton") and not e4m3.use_mma("numpy")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("block_n", [64, 128])
def test_sm90_dots_are_fp8_wgmma_from_shared_memory(block_n, tmp_path, monkeypatch):
    """Llama's layer (4 query heads a KV head, 128 dims, bf16 q): the whole-tile loop's two dots are FP8 wgmmas
    (QGMMA) whose cache operands are read where cp.async put them (no F2FP conversion, no fp16 HMMA); the converting
    loop's (FP8_MMA off) has the conversions, for contrast; neither spills (aot_sm90 checks)."""
    from test_kernels_kv_int8 import aot_sm90

    from tools.sass_mix import loops

    mixes = {}
    for mma in (True, False):
        built = aot_sm90("decode", (None, pa.paged_decode_fp8_kernel, None), {}, "*u8", tmp_path, monkeypatch,
                         BLOCK_N=block_n, FP8_CVT=True, V_TOKEN_MINOR=True, FP8_MMA=mma)
        assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in built.asm["ptx"] or not mma
        mixes[mma] = loops(built.asm["cubin"])
    main = min(mixes[True], key=lambda mix: mix.opcodes["LDG"])  # the whole tiles' loop: its tiles come by cp.async
    assert main.opcodes["QGMMA"] > 0 and main.opcodes["LDG"] == 0 and main.opcodes["LDGSTS"] > 0
    assert main.opcodes["F2FP"] == main.opcodes["HMMA"] == 0
    assert all(mix.opcodes["F2FP"] > 0 and mix.opcodes["QGMMA"] == 0 for mix in mixes[False])
