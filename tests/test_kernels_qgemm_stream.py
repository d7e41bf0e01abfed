"""dequant_gemm's variant "stream" (kernels_src/dequant_gemm_stream*.py: a step's weights 2-D tiles of 32-bit words
decoded in x's stored order, one dot over x as stored) for Q4_K and Q6_K against the float64 reference, on the DSL
interpreter and Triton's: step sizes, split-K, swap, ragged N tiles, Q6_K's 2-byte aligned blocks, Q4_K's 16-bit
decode under fp16 and bf16 x; planted decoding bugs fail; rows that are not whole words are refused or (a table's
choice) take blocked; the sm_90 AOT builds read W only through cp.async, feed wgmma from x's buffer and spill
nothing."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS
from test_kernels_gemm import _run, close, needs_aot
from test_kernels_gemv import _stack_bytes, padded_weights
from test_kernels_qgemm_variants import _aot, check_fp16_and_bf16

from kernels_src import dequant_gemm as dgm
from kernels_src import dequant_gemm_stream as stream
from kernels_src import dequant_gemm_stream_q6k as q6k
from kernels_src.dsl import launch as dsl_launch
from kernels_src.dsl import tl


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype,m,blocks,opts", [
    ("Q4_K", 9, 1, {}), ("Q4_K", 33, 3, dict(split_k=2, chunks=4)), ("Q4_K", 64, 2, dict(block_n=32, chunks=1)),
    ("Q4_K", 18, 2, dict(swap=False, block_n=16, block_m=32, split_k=3, chunks=1)),
    ("Q4_K", 2, 4, dict(block_n=64, split_k=4, chunks=4)), ("Q4_K", 16, 3, dict(split_k=4)),
    ("Q6_K", 9, 2, {}), ("Q6_K", 33, 4, dict(split_k=2, chunks=4)),
    ("Q6_K", 64, 2, dict(block_n=32, chunks=1, split_k=3)),
    ("Q6_K", 18, 4, dict(swap=False, block_n=16, block_m=32, split_k=3, chunks=1)), ("Q6_K", 16, 2, dict(chunks=4))])
def test_stream_matches_reference(target, qtype, m, blocks, opts, rng):
    """Variant stream on 0xFF-padded rows (37: N tiles ragged): K of 1-4 super-blocks (Q6_K's at even and odd places
    of the row, 4- and 2-byte aligned: odd ones read as funnels of word pairs), steps of a quarter, half (the
    default) or a whole super-block, split-K over uneven steps, x @ W.T, 2 to 64 rows."""
    k = 256 * blocks
    w = padded_weights(rng, qtype, 37, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = _run(target, x, w, qtype, np.float32, variant="stream", **opts)
    close(got, dgm.dequant_matmul_ref(x, w, qtype), 1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 x needs torch")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_stream_fp16_and_bf16(qtype, rng):
    check_fp16_and_bf16(rng, "stream", qtype)


def _swapped_nibbles():
    """field_scale with the nibbles' factors exchanged (a high nibble scaled as a low one)."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    return tl.where(i % 2 == 1, 2.0 ** -8, 1.0) * tl.where(h == 0, 0.0625, 1.0)


def _in_place(words):
    """quant_tile without the 16-bit shift for bytes 2 and 3 (their high nibbles then reach the exponent)."""
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    field = words & (15 << (8 * (i % 2) + 4 * h))
    return (field | stream.dq.MAGIC).to(tl.float32, bitcast=True) - float(2 ** 23)


def _no_funnel(blk, odd, first: int, count: int):
    """block_words reading odd blocks as if they started on a word."""
    return tl.load(blk + first + tl.arange(0, count)[None, :])


_scales, _q6_quant = stream.scales, q6k.quant_tile
STREAM_BUGS = {  # a decoding bug -> (module, attribute, planted version)
    "nibbles swapped": (stream, "field_scale", _swapped_nibbles),
    "bytes 2, 3 read in place": (stream, "quant_tile", _in_place),
    "min ignored": (stream, "scales", lambda *a: (_scales(*a)[0], 0.0 * _scales(*a)[1])),
    "Q6_K odd blocks unshifted": (q6k, "block_words", _no_funnel),
    "Q6_K high bits of the wrong pair": (q6k, "quant_tile", lambda ql, qh, n: _q6_quant(ql, qh >> 2, n)),
}


@pytest.mark.parametrize("bug", STREAM_BUGS)
def test_stream_planted_bug_fails(bug, rng, monkeypatch):
    qtype = "Q6_K" if bug.startswith("Q6_K") else "Q4_K"
    w = padded_weights(rng, qtype, 13, 512)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    want = dgm.dequant_matmul_ref(x, w, qtype)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(*STREAM_BUGS[bug])
    with pytest.raises(AssertionError, match="Not equal to tolerance|NaN"):
        close(_run("numpy", x, w, qtype, np.float32, variant="stream", chunks=4), want, 1e-5)


def _half_in_place(words, dtype):
    """quant_tile_half with both nibbles masked where they lie: right for fp16, but bf16's 7 mantissa bits cannot
    hold a high nibble in place."""
    magic, base = stream.HALF_MAGIC[dtype.name]
    h = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    field = (words >> 8 * i) & tl.where(h == 1, 0xF0, 0x0F)
    return (field | magic).to(tl.uint16).to(dtype, bitcast=True) - base


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 x needs torch")
@pytest.mark.parametrize("planted", [("quant_tile_half", _half_in_place),
                                     ("half_scale", lambda dtype: tl.full((1, 1, 2, 1, 1), 1.0, tl.float32))])
def test_stream_half_decode_planted_bug_fails(planted, rng, monkeypatch):
    """The 16-bit decode (x fp16 or bf16) has its own planted bugs: bf16's high nibble masked in place (it overflows
    the mantissa), fp16's high nibble left 16 times too large."""
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(stream, *planted)
    with pytest.raises(AssertionError, match="Not equal to tolerance|NaN"):
        check_fp16_and_bf16(rng, "stream")


def test_stream_needs_word_rows_and_tuned_picks_it(rng, monkeypatch):
    """Rows off a 4-byte boundary: refused when stream is asked for, the general kernel when a table chose it; on
    word rows the table's stream runs."""
    w = padded_weights(rng, "Q4_K", 11, 256, pad=6)  # rows of 144 bytes at a stride of 166
    x = rng.standard_normal((16, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="variant stream reads Q4_K rows as 32-bit words"):
        dgm.dequant_matmul(x, w, "Q4_K", variant="stream")
    with pytest.raises(ValueError, match="variant stream takes 1, 2 or 4 .* not chunks=3"):
        dgm.dequant_matmul(x, padded_weights(rng, "Q4_K", 11, 256), "Q4_K", variant="stream", chunks=3)
    with pytest.raises(ValueError, match="variant 'stream' does not take Q5_K"):
        dgm.dequant_matmul(x, padded_weights(rng, "Q5_K", 11, 256), "Q5_K", variant="stream")
    with pytest.raises(ValueError, match="variant stream reads Q6_K rows as 32-bit words"):  # 210 bytes: odd blocks
        dgm.dequant_matmul(x, padded_weights(rng, "Q6_K", 11, 256), "Q6_K", variant="stream")
    monkeypatch.setitem(dgm.TUNED, ("Q4_K", 16, 11, 256), dict(variant="stream", block_n=32, split_k=1, chunks=4))
    close(_run("numpy", x, w, "Q4_K", np.float32), dgm.dequant_matmul_ref(x, w, "Q4_K"), 1e-5)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(*STREAM_BUGS["min ignored"])
    w4 = padded_weights(rng, "Q4_K", 11, 256)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(_run("numpy", x, w4, "Q4_K", np.float32), dgm.dequant_matmul_ref(x, w4, "Q4_K"), 1e-5)


@needs_aot
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_aot_sm90(qtype, tmp_path, monkeypatch):
    """At 64 x 128 tiles, 8 warps, the default step: wgmma whose B is x's cp.async buffer (x not read back: the loop's
    local_loads are W's), one wgmma left in flight, W only through cp.async (Q4_K's quants 16 bytes a copy), no
    spills."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = stream.dequant_gemm_stream_kernel if qtype == "Q4_K" else q6k.dequant_gemm_stream_q6k_kernel
    c = _aot(fn, dict(BLOCK_M=64, BLOCK_N=128, SWAP=True, CHUNKS=dgm.STREAM_CHUNKS),
             dict(w="*i32", x="*bf16", y="*fp32"), 8, tmp_path)
    ptx, loop = c.asm["ptx"], c.asm["ttgir"].split("scf.for")[1].split("scf.yield")[0]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx and "ld.global" not in ptx
    assert "pendings = 1" in loop and "bf16" not in "".join(ln for ln in loop.splitlines() if "local_load" in ln)
    assert qtype == "Q6_K" or "cp.async.cg.shared.global" in ptx and ", 0x10," in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
