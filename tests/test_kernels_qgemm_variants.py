"""The quantized GEMMs' new variants against the existing references: dequant_gemm's "words" (Q4_K / Q5_K headers
as 32-bit words) and "sub64" (Q4_K, 64-input steps, every W load a 32-bit word) and int_group_gemm's "gather" (a q
word per weight element), on the DSL interpreter and Triton's, tiles, split-K, swap and dtypes varied; planted
decoding bugs fail; TUNED entries pick their variant; the sm_90 AOT builds use wgmma with every global load of W
staged by cp.async and nothing spilled (variant stream: tests/test_kernels_qgemm_stream.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemm import _run, close, needs_aot
from test_kernels_gemv import _stack_bytes, padded_weights
from test_kernels_int_group_gemm import TOL, matches_references, planted_fails, quantized, run

from kernels_src import dequant_gemm as dgm
from kernels_src import dequant_gemm_q4k as q4k
from kernels_src import int_group_gemm as igm
from kernels_src import int_group_gemm_gather as gather
from kernels_src.dsl import launch as dsl_launch


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m,blocks,opts", [(9, 2, {}), (33, 3, dict(split_k=2)), (18, 1, dict(split_k=3)),
                                           (16, 2, dict(swap=False, block_n=16, block_m=32)),
                                           (20, 2, dict(block_n=32, split_k=1))])
def test_sub64_matches_reference(target, m, blocks, opts, rng):
    """Q4_K through variant sub64 on rows padded with 0xFF (read, they decode to NaN): 1-3 super-blocks, split-K over
    uneven steps, x @ W.T, ragged N tiles."""
    k = 256 * blocks
    w = padded_weights(rng, "Q4_K", 37, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = _run(target, x, w, "Q4_K", np.float32, variant="sub64", **opts)
    close(got, dgm.dequant_matmul_ref(x, w, "Q4_K"), 1e-5)


def check_fp16_and_bf16(rng, variant: str, qtype: str = "Q4_K"):
    """A variant on fp16 x (the DSL interpreter) and bf16 x (torch tensors) against the reference."""
    import torch

    w = padded_weights(rng, qtype, 19, 512)
    x = rng.standard_normal((12, 512)).astype(np.float16)
    close(_run("numpy", x, w, qtype, np.float16, variant=variant), dgm.dequant_matmul_ref(x, w, qtype), 2e-3)
    xb = torch.from_numpy(x.astype(np.float32)).bfloat16()
    out = torch.full((12, 19), float("nan"), dtype=torch.bfloat16)
    dgm.dequant_matmul(xb, w, qtype, out=out, variant=variant)
    close(out.float().numpy(), dgm.dequant_matmul_ref(xb.float().numpy(), w, qtype), 1.5e-2)


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 x needs torch")
def test_sub64_fp16_and_bf16(rng):
    check_fp16_and_bf16(rng, "sub64")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("m,blocks,opts", [(9, 2, {}), (33, 3, dict(split_k=2)),
                                           (18, 2, dict(swap=False, block_n=16, block_m=32, split_k=3))])
def test_words_matches_reference(target, qtype, m, blocks, opts, rng):
    """The blocked kernel with the header read as words, on 0xFF-padded rows: Q4_K and Q5_K (same header)."""
    k = 256 * blocks
    w = padded_weights(rng, qtype, 37, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    close(_run(target, x, w, qtype, np.float32, variant="words", **opts), dgm.dequant_matmul_ref(x, w, qtype), 1e-5)


def test_words_planted_bug_fails(rng, monkeypatch):
    """A scale word off by one byte (the sub-block's neighbour's 6-bit scale) fails the check."""
    from kernels_src import dequantize as dq

    w = padded_weights(rng, "Q4_K", 13, 512)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    head = dq._k4_head

    def shifted(blk, WORDS):
        d, dmin, sw = head(blk, WORDS)
        return d, dmin, [s >> 8 for s in sw]

    monkeypatch.setattr(dq, "_k4_head", shifted)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(_run("numpy", x, w, "Q4_K", np.float32, variant="words"), dgm.dequant_matmul_ref(x, w, "Q4_K"), 1e-5)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q8_0"])
def test_blocked_named_takes_every_type(qtype, rng):
    k = 256
    w = padded_weights(rng, qtype, 21, k)
    x = rng.standard_normal((17, k)).astype(np.float32)
    close(_run("numpy", x, w, qtype, np.float32, variant="blocked"), dgm.dequant_matmul_ref(x, w, qtype), 1e-5)
    with pytest.raises(ValueError, match=f"variant 'sub64' does not take {qtype}"):
        dgm.dequant_matmul(x, w, qtype, variant="sub64")


SUB64_BUGS = {  # a decoding bug -> (module attribute, planted version)
    "scale of the other sub-block": ("scale_min", lambda blk, p, half: _scale_min(blk, p, 1 - half)),
    "min ignored": ("scale_min", lambda blk, p, half: (_scale_min(blk, p, half)[0], 0.0 * _scale_min(blk, p, half)[1])),
}
_scale_min = q4k.scale_min


@pytest.mark.parametrize("bug", SUB64_BUGS)
def test_sub64_planted_bug_fails(bug, rng, monkeypatch):
    w = padded_weights(rng, "Q4_K", 13, 512)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    want = dgm.dequant_matmul_ref(x, w, "Q4_K")
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(q4k, *SUB64_BUGS[bug])
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(_run("numpy", x, w, "Q4_K", np.float32, variant="sub64"), want, 1e-5)


def test_sub64_needs_word_rows_and_tuned_picks_it(rng, monkeypatch):
    """Rows off a 4-byte boundary: refused when sub64 or words is asked for, the general kernel when a table chose
    it."""
    w = padded_weights(rng, "Q4_K", 11, 256, pad=6)  # rows of 144 bytes at a stride of 166
    x = rng.standard_normal((16, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="sub64 reads Q4_K rows as 32-bit words"):
        dgm.dequant_matmul(x, w, "Q4_K", variant="sub64")
    with pytest.raises(ValueError, match="variant words reads Q4_K headers as 32-bit words"):
        dgm.dequant_matmul(x, w, "Q4_K", variant="words")
    monkeypatch.setitem(dgm.TUNED, ("Q4_K", 16, 11, 256), dict(variant="sub64", block_n=32, split_k=1))
    assert dgm.tuned_variant("Q4_K", 12, 11, 256) == "sub64" and dgm.tuned_variant("Q4_K", 17, 11, 256) == "blocked"
    close(_run("numpy", x, w, "Q4_K", np.float32), dgm.dequant_matmul_ref(x, w, "Q4_K"), 1e-5)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(q4k, "scale_min", SUB64_BUGS["min ignored"][1])  # the table's variant runs on word rows
    w4 = padded_weights(rng, "Q4_K", 11, 256)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(_run("numpy", x, w4, "Q4_K", np.float32), dgm.dequant_matmul_ref(x, w4, "Q4_K"), 1e-5)


# (bits, group, K, rows, symmetric, split, bk): a group a step, two groups a step (scales gathered a column), a
# 128-group in 32- and 64-input slices, a group of 96 (not a power of two), 8 bits
GATHER = [(4, 32, 128, 9, False, 1, None), (4, 32, 256, 17, True, 2, 64), (4, 128, 512, 16, False, 3, 32),
          (4, 128, 256, 64, False, 1, None), (4, 96, 192, 9, True, 2, None), (8, 32, 128, 17, False, 1, 128),
          (8, 128, 384, 33, True, 2, 64)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k,m,sym,split,bk", GATHER)
def test_gather_matches_references(target, bits, group, k, m, sym, split, bk, rng):
    matches_references(target, rng, bits, group, k, m, sym, split_k=split, variant="gather", bk=bk)


@pytest.mark.parametrize("target", TARGETS)
def test_gather_tiles_and_fp16(target, rng):
    w, w64 = quantized(rng, 29, 256, 4, 64, False)
    x = rng.standard_normal((18, 256)).astype(np.float16)
    got = run(target, x, w, 4, 64, np.float16, variant="gather", swap=False, block_n=16)
    close(got, igm.int_group_matmul_ref(x.astype(np.float32), w, 4, 64), TOL[np.float16])


@pytest.mark.parametrize("planted", [
    lambda words, k, BITS, GROUP: (words >> (((k % GROUP) % (32 // BITS)) * BITS + BITS)) & ((1 << BITS) - 1),
    lambda words, k, BITS, GROUP: (words >> ((32 // BITS - 1 - (k % GROUP) % (32 // BITS)) * BITS)) & 15])
def test_gather_planted_bug_fails(planted, rng, monkeypatch):
    planted_fails(rng, monkeypatch, gather, "gather_q", planted, variant="gather")


def test_gather_errors_and_tuned(rng, monkeypatch):
    w, w64 = quantized(rng, 5, 96, 4, 96, False)
    x = rng.standard_normal((9, 96)).astype(np.float32)
    with pytest.raises(ValueError, match="gather step of 64 inputs does not tile groups of 96"):
        igm.int_group_matmul(x, w, 4, 96, variant="gather", bk=64)
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        igm.int_group_matmul(x, w, 4, 96, variant="fast")
    monkeypatch.setitem(igm.TUNED, (4, 96, 16, 5, 96), dict(variant="gather", bk=32, block_n=16))
    assert igm.tuned_variant(9, 5, 96, 4, 96) == "gather" and igm.default_tiles(9, 5, 96, 4, 96)["BK"] == 32
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(gather, "gather_q", lambda words, k, BITS, GROUP: words & 0)  # the table's kernel runs
    out = dev(np.zeros((9, 5), np.float32), "numpy")
    igm.int_group_matmul(x, w, 4, 96, out=out)
    assert not np.allclose(host(out), x.astype(np.float64) @ w64.T, rtol=1e-3)


def _aot(fn, consts: dict, sig: dict, nw: int, tmp_path):
    from kernels_src.dsl.triton_target import aot_compile

    kern = dsl_launch.compile(fn, "triton", PDL=True, **consts)
    kir = kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig})
    return aot_compile(kir, arch=90, num_warps=nw, num_stages=3, aligned=True)


@needs_aot
@pytest.mark.parametrize("which", ["sub64", "gather", "words"])
def test_aot_sm90(which, tmp_path, monkeypatch):
    """At 64 x 128 tiles and 8 warps: wgmma, and W read only through cp.async (no synchronous global load in the
    build at all), no spills."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tiles = dict(BLOCK_M=64, BLOCK_N=128, SWAP=True)
    if which == "words":
        c = _aot(dgm.dequant_gemm_kernel, dict(tiles, QTYPE="Q4_K", KB=1, WIDE=True, WORDS=True),
                 dict(w="*u8", x="*bf16", y="*fp32"), 8, tmp_path)
    elif which == "sub64":
        c = _aot(q4k.dequant_gemm_q4k_kernel, tiles, dict(w="*i32", x="*bf16", y="*fp32"), 8, tmp_path)
    else:
        c = _aot(gather.int_group_gemm_gather_kernel, dict(tiles, BITS=4, GROUP=128, BK=64),
                 dict(w="*i32", x="*bf16", y="*fp32"), 8, tmp_path)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx and "ld.global" not in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
