"""int_group_gemm's variant "stream" (kernels_src/int_group_gemm_stream.py: the word tile split by field, a dot each,
x permuted to match, fields decoded by the magic exponent) against x @ ((q - z) * s).T in float64 and the numpy
dequantizer's reference, on the DSL interpreter and Triton's: 4 and 8 bits, groups of 32 / 128 / a whole row / 96 (a
scale a word column), sym and asym, ragged N, several M, split-K, swap, fp16; planted decoding bugs fail; the sm_90
build has no I2F, no synchronous global load and no shared-memory store of W in its loop, and spills nothing."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS
from test_kernels_gemv import _stack_bytes, needs_aot
from test_kernels_int_group_gemm import TOL, close, matches_references, planted_fails, quantized, run

from kernels_src import int_group_gemm as igm
from kernels_src import int_group_gemm_stream as stream
from kernels_src.dsl import launch as dsl_launch

FIELD_Q = stream.field_q  # the real decoder, which the planted bugs wrap


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# (bits, group, K, rows, symmetric, split): 4 groups of 32 a step (per-column scales), a 128-group a step over 2
# splits, a whole-row group (256: 128-input slices of it), groups of 96 straddling steps, 8 bits (a step of 4 groups
# of 32; a 128-group), M from 9 to 64
STREAM = [(4, 32, 128, 9, False, 1), (4, 128, 384, 17, True, 2), (4, 256, 256, 33, False, 1),
          (4, 96, 384, 16, False, 3), (8, 32, 128, 24, True, 1), (8, 128, 256, 64, False, 2)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k,m,sym,split", STREAM)
def test_stream_matches_references(target, bits, group, k, m, sym, split, rng):
    matches_references(target, rng, bits, group, k, m, sym, split_k=split, variant="stream")


@pytest.mark.parametrize("target", TARGETS)
def test_stream_tiles_and_fp16(target, rng):
    """x @ W.T (W the B operand), 16-wide N tiles (29 rows: two ragged tiles), a 256-input step, fp16 x."""
    w, w64 = quantized(rng, 29, 512, 4, 128, False)
    x = rng.standard_normal((18, 512)).astype(np.float16)
    got = run(target, x, w, 4, 128, np.float16, variant="stream", swap=False, block_n=16, bk=256)
    close(got, igm.int_group_matmul_ref(x.astype(np.float32), w, 4, 128), TOL[np.float16])


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 x needs torch")
def test_stream_bf16_equals_blocked(rng):
    """bf16 x (the engine's): the same W values meet the dot as in blocked (its sums in another order), so y is
    blocked's within a bf16 rounding, and x @ W.T's within bf16's error."""
    import torch

    w, w64 = quantized(rng, 37, 512, 4, 128, True)
    x = torch.randn((16, 512), generator=torch.Generator().manual_seed(1)).bfloat16()
    got = {v: igm.int_group_matmul(x, w, 4, 128, variant=v) for v in ("blocked", "stream")}
    close(got["stream"].float().numpy(), got["blocked"].float().numpy(), 2**-8)
    close(got["stream"].float().numpy(), x.double().numpy() @ w64.T, 1e-2)


@pytest.mark.parametrize("target", TARGETS)
def test_stream_accumulators(target, rng):
    """8 bits (4 fields a word): a loop-carried accumulator a field (the rule's choice at 16 x 64 tiles) and one."""
    w, w64 = quantized(rng, 21, 256, 8, 64, False)
    x = rng.standard_normal((12, 256)).astype(np.float32)
    assert stream.accs_for(8, 16, 64, 4, True) == 4 and stream.accs_for(8, 64, 64, 4, True) == 1
    for accs in (4, 1):
        got = run(target, x, w, 8, 64, variant="stream", accs=accs, split_k=2)
        close(got, x.astype(np.float64) @ w64.T, TOL[np.float32])


def test_permute_x_order(rng):
    """Step position j * C + c holds input c * PER + j (PER = 8 at 4 bits, C = 16 words at 128 inputs)."""
    x = rng.standard_normal((3, 256))
    p = stream.permute_x(x, 128, 4)
    s, c, j = 1, 5, 3
    assert p[2, s * 128 + j * 16 + c] == x[2, s * 128 + c * 8 + j]
    assert sorted(p[0]) == sorted(x[0])


def _zero_off(lo, hi, j, BITS):
    q, at = FIELD_Q(lo, hi, j, BITS)
    return q + float(1 << at), at


@pytest.mark.parametrize("planted", [
    lambda lo, hi, j, BITS: FIELD_Q(lo, hi, (j + 1) % (32 // BITS), BITS),  # nibble order
    lambda lo, hi, j, BITS: (FIELD_Q(lo, hi, j, BITS)[0], 0),  # the field's place not taken out of the scale
    lambda lo, hi, j, BITS: FIELD_Q(lo, lo, j, BITS),  # the high half read from the low one
    _zero_off])  # the zero point off by one
def test_stream_planted_bug_fails(planted, rng, monkeypatch):
    planted_fails(rng, monkeypatch, stream, "field_q", planted, variant="stream")


def test_stream_errors_and_tuned(rng, monkeypatch):
    w, w64 = quantized(rng, 5, 192, 4, 96, False)
    x = rng.standard_normal((9, 192)).astype(np.float32)
    with pytest.raises(ValueError, match="stream step of 128 inputs does not tile a row of 192 at 4 bits"):
        igm.int_group_matmul(x, w, 4, 96, variant="stream")
    with pytest.raises(ValueError, match="stream step of 64 inputs"):
        igm.int_group_matmul(x, w, 4, 96, variant="stream", bk=64)  # 8 words: shallower than a dot
    with pytest.raises(ValueError, match="stream takes 1 or 8 accumulators at 4 bits, not 3"):
        igm.int_group_matmul(x[:, :128], quantized(rng, 5, 128, 4, 128, False)[0], 4, 128, variant="stream", accs=3)
    monkeypatch.setitem(igm.TUNED, (4, 96, 16, 5, 192), dict(variant="stream", bk=192))
    assert igm.tuned_variant(9, 5, 192, 4, 96) == "stream"
    with pytest.raises(ValueError, match="power of two"):  # the table's variant and step are the ones run
        igm.int_group_matmul(x, w, 4, 96)


@needs_aot
@pytest.mark.parametrize("tiles,nw", [(dict(BLOCK_M=16, BLOCK_N=64, SWAP=True), 4),
                                      (dict(BLOCK_M=64, BLOCK_N=64, SWAP=False), 4)])
def test_stream_aot_sm90(tiles, nw, tmp_path, monkeypatch):
    """The TUNED tiles of 16 and 64 rows: wgmma; W and x only through cp.async; the loop without I2F and (W as the
    register operand) without a shared-memory store, its dots not waited for one by one; no spills."""
    from kernels_src.dsl.triton_target import aot_compile
    from tools.sass_mix import loop_mix

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    accs = stream.accs_for(4, tiles["BLOCK_M"], tiles["BLOCK_N"], nw, tiles["SWAP"])
    kern = dsl_launch.compile(stream.int_group_gemm_stream_kernel, "triton", PDL=True, BITS=4, GROUP=128, BK=128,
                              ACCS=accs, **tiles)
    sig = dict(w="*i32", x="*bf16", y="*fp32")
    c = aot_compile(kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig}), arch=90,
                    num_warps=nw, num_stages=3, aligned=True)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx and "ld.global" not in ptx
    mix = loop_mix(c.asm["cubin"])
    assert not {"I2F", "I2FP"} & set(mix.opcodes) and mix.stack == 0
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
    if tiles["SWAP"]:  # and a step's 8 wgmmas in flight together (a field's accumulator each)
        assert "STS" not in mix.opcodes and accs == 8 and "pendings = 7" in c.asm["ttgir"], mix.summary()
