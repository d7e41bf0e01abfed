"""dequant_gemv's int8 path for Q6_K with W read as 32-bit words (tile key words, dequant_gemv_i8.WORD_LOADS): the
same outputs as the 16-bit loads and within the int8 bound of the reference, on both interpreters, rows padded with
0xFF; a planted funnel bug fails; rows it cannot read are refused or (from a table) take the 16-bit loads; the sm_90
build has no sub-word global load."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, TOL, dev, host
from test_kernels_gemm import needs_aot
from test_kernels_gemv import padded_weights

from kernels_src import dequant_gemv as dg
from kernels_src import dequant_gemv_i8 as dgi
from kernels_src.dsl import launch as dsl_launch


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def gemv(target, x, w, **kw):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, np.float32), target)
    dg.dequant_gemv(dev(x, target), dev(w, target), "Q6_K", out=out, target=target, int8_x=True, **kw)
    return host(out).astype(np.float64)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m,n,blocks,tiles", [(1, 5, 2, dict(rows=2, step=4)), (3, 4, 4, dict(rows=1, step=2)),
                                              (5, 3, 2, dict(rows=4, step=8))])
def test_words_match_half_words_and_reference(target, m, n, blocks, tiles, rng):
    """Odd and even blocks (2 mod 4 and 0 mod 4 bytes), steps past the row's end (its last block read again, scales
    masked), ragged row tiles: the word loads give the 16-bit loads' outputs exactly, within the int8 bound."""
    k = 256 * blocks
    w = padded_weights(rng, "Q6_K", n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = gemv(target, x, w, words=True, **tiles)
    np.testing.assert_array_equal(got, gemv(target, x, w, words=False, **tiles))
    want = dg.dequant_gemv_ref(x, w, "Q6_K").astype(np.float64)
    bound = dgi.int8_error_bound(x, w, "Q6_K") + TOL[np.float32]["rtol"] * np.abs(want).max()
    assert np.isfinite(got).all() and (np.abs(got - want) <= bound).all()


def test_words_on_the_simt_fiber_oracle(rng):
    """The SIMT lowering (C++ fibers) of the word loader: the 16-bit loads' outputs exactly."""
    w = padded_weights(rng, "Q6_K", 3, 512)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    np.testing.assert_array_equal(gemv("simt-cpu", x, w, words=True), gemv("simt-cpu", x, w, words=False))


def test_words_planted_bug_fails(rng, monkeypatch):
    """A funnel that ignores the block's 2-byte offset (right for even blocks only) fails."""
    w = padded_weights(rng, "Q6_K", 4, 512)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    right = gemv("numpy", x, w, words=True)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(dgi, "_funnel", lambda lo, hi, sh: lo)
    wrong = gemv("numpy", x, w, words=True)
    assert not np.allclose(wrong, right, rtol=1e-3, atol=1e-3 * np.abs(right).max())


def test_rows_words_cannot_read(rng, monkeypatch):
    """words on rows 2 mod 4 bytes apart, on an odd number of blocks, or on the fp32 path: a clear error; a table's
    words on such rows takes the 16-bit loads."""
    x = rng.standard_normal((1, 768)).astype(np.float32)
    odd = padded_weights(rng, "Q6_K", 3, 768)  # 3 blocks a row
    unaligned = padded_weights(rng, "Q6_K", 3, 512, pad=18)
    for w, xs in ((odd, x), (unaligned, x[:, :512])):
        with pytest.raises(ValueError, match="even number of blocks"):
            gemv("numpy", xs, w, words=True)
    with pytest.raises(ValueError, match="int8-activation path"):
        dg.dequant_gemv(x[:, :512], padded_weights(rng, "Q6_K", 3, 512), "Q6_K", words=True, int8_x=False)
    monkeypatch.setitem(dg.TUNED, ("Q6_K", 1, 3, 768), dict(ROWS=1, STEP=4, PARTS=1, num_warps=1, words=True))
    np.testing.assert_array_equal(gemv("numpy", x, odd), gemv("numpy", x, odd, words=False, rows=1, step=4))
    with pytest.raises(ValueError, match="only Q6_K have a word loader"):
        dg.dequant_gemv(x[:, :512], padded_weights(rng, "Q4_K", 3, 512), "Q4_K", words=True, int8_x=True)
    with pytest.raises(ValueError, match="words is a bool for Q6_K only"):
        dg.check_tiles("Q4_K", dict(ROWS=1, STEP=4, PARTS=1, num_warps=1, words=True))


@needs_aot
@pytest.mark.parametrize("words", [False, True])
def test_aot_sm90_no_subword_loads(words, tmp_path, monkeypatch):
    """The int8 Q6_K GEMV at the rule's tiles for sm_90: 88 ld.global.b16 (16-bit loads) with words off, none on."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    t = dg.rule_tiles("Q6_K", 1, 14336)
    kern = dsl_launch.compile(dgi.dequant_gemv_i8_kernel, "triton", QTYPE="Q6_K", M=1, ROWS=t["ROWS"], STEP=t["STEP"],
                              PDL=True, WORDS=words)
    sig = dict(w="*u8", xq="*i8", xd="*fp32", y="*bf16")
    kir = kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig})
    ptx = aot_compile(kir, arch=90, num_warps=t["num_warps"], num_stages=3, aligned=True).asm["ptx"]
    sub = re.findall(r"ld\.global(?:\.\w+)*\.[bsu](?:8|16)\b", ptx)
    assert (len(sub) == 0) if words else (len(sub) == 88), sub


@pytest.mark.skipif(not HAS_TRITON, reason="the sweep's check runs on torch tensors")
def test_sweep_times_words_beside_the_rule(monkeypatch):
    """tools/sweep_gemv's essentials for Q6_K hold the rule's tiles with words, as a setting that survives its key,
    and the sweep's own check passes it on the interpreter."""
    from tools import sweep_gemv as sweep

    ess = sweep.essentials("Q6_K", 1, 4096, 14336)
    rule = dg.rule_tiles("Q6_K", 1, 4096)
    assert ess[:3] == [rule, rule | {"int8_x": False}, rule | {"words": True}]
    tuned = dg.TUNED[("Q6_K", 1, 4096, 14336)]
    assert ess[3] == tuned | {"words": True}  # TUNED's entry reads words itself (or gets its words twin)
    assert all(sweep._s(sweep._t(s)) == s for s in ess) and "words" not in str(sweep.essentials("Q4_K", 1, 16, 256))
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(dgi, "I8_TARGETS", ("numpy",))
    monkeypatch.setattr(sweep, "TARGET", "numpy")
    assert sweep._check_one("Q6_K", 1, ess[2], 8, 512) is None
