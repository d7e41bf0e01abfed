"""The grouped MoE kernel over GGUF stacks with Q4_K / Q5_K headers read as 32-bit words (moe_gguf's WORDS, as
dequant_gemm's variant words): against gguf-py's decoding on both interpreters, through moe_experts with the default
switched on; a planted header bug fails; unaligned stacks are refused; the sm_90 build has no sub-word global load."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from test_gguf_quants import random_raw
from test_kernels_basic import TARGETS, dev, host
from test_kernels_gemm import needs_aot
from test_kernels_moe import routing
from test_kernels_moe_gguf import RANDOM_SCALE, TOL, WIDE_N, check, gguf_py_dense, on

from ir.formats.gguf_quants import row_bytes
from kernels_src import moe, moe_gguf
from kernels_src.dsl import launch as dsl_launch


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def word_stack(rng, qtype: str, experts: int, out: int, k: int, pad: int = 8):
    """A stack as a view into rows padded with 0xFF bytes (pad past each row: 8 keeps rows 4-byte aligned, 6 does
    not), which decode to NaN if read."""
    n, rb = experts * out, row_bytes(qtype, k)
    big = np.full((n + 2, rb + pad), 0xFF, np.uint8)
    big[:n, :rb] = random_raw(qtype, (n, k), rng, RANDOM_SCALE[qtype]).reshape(n, rb)
    return moe_gguf.GGUFStack(big[:n, :rb], qtype, (experts, out, k))


def problem(rng, tokens: int, qtypes, experts: int = 4, top_k: int = 2, hidden: int = 256, inner: int = 256):
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids, w = routing(rng, tokens, experts, top_k, True)
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    return (x, w, ids, *(word_stack(rng, q, experts, *s) for q, s in zip(qtypes, shapes, strict=True)))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtypes", [("Q4_K",) * 3, ("Q5_K", "Q4_K", "Q6_K")])
def test_words_match_reference(target, qtypes, rng, monkeypatch):
    """moe_experts' grouped passes with WORDS on: Q4_K throughout, and Q4_K_M-like mixes (Q5_K gate beside Q4_K up,
    Q6_K down, which keeps its own loads), 9 tokens crowding two experts."""
    monkeypatch.setattr(moe_gguf, "WORDS", True)
    check(target, problem(rng, 9, qtypes), **WIDE_N[target])


def _launch_gated(args, words, target="numpy"):
    """The gated pass alone through moe_gguf.launch: h [slots, inner]."""
    x, w, ids, gate, up, _ = args
    s, inner = ids.size, gate.shape[1]
    rows, block_expert = moe.moe_align(ids, gate.shape[0], 16)
    h = dev(np.full((s, inner), np.nan, np.float32), target)
    moe_gguf.launch(dev(x, target), on(target, gate), on(target, up), h, rows, block_expert, w.reshape(-1), s,
                    x.shape[1], gated=True, top_k=ids.shape[1], act="silu", block_m=16, block_n=16, target=target,
                    pdl=False, words=words)
    return np.asarray(host(h), np.float64)


def _gated_ref(args):
    x, _, ids, gate, up, _ = args
    g, u = gguf_py_dense(gate), gguf_py_dense(up)
    e, t = ids.reshape(-1), np.repeat(np.arange(ids.shape[0]), ids.shape[1])
    a = np.einsum("sk,sok->so", x[t].astype(np.float64), g[e])
    return a / (1 + np.exp(-a)) * np.einsum("sk,sok->so", x[t].astype(np.float64), u[e])


def test_words_planted_bug_fails(rng, monkeypatch):
    """The gated pass right with words, then wrong with each scale word shifted by a byte (a neighbour's scales)."""
    from kernels_src import dequantize as dq

    args = problem(rng, 5, ("Q4_K",) * 3)
    want = _gated_ref(args)
    tol = dict(rtol=TOL[np.float32], atol=TOL[np.float32] * np.abs(want).max())
    np.testing.assert_allclose(_launch_gated(args, True), want, **tol)
    head = dq._k4_head

    def shifted(blk, WORDS):
        d, dmin, sw = head(blk, WORDS)
        return d, dmin, sw if sw is None else [s >> 8 for s in sw]
    monkeypatch.setattr(dq, "_k4_head", shifted)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    assert not np.allclose(_launch_gated(args, True), want, **tol)


def test_unaligned_stacks_refused(rng):
    """words on rows 2 mod 4 bytes apart is a clear error; left to the default, such stacks take the byte loads."""
    x, w, ids, *_ = problem(rng, 3, ("Q4_K",) * 3)
    gate, up = (word_stack(rng, "Q4_K", 4, 256, 256, pad=6) for _ in range(2))
    assert not moe_gguf.whole_words(gate, up)
    with pytest.raises(ValueError, match="4-byte aligned"):
        _launch_gated((x, w, ids, gate, up, None), True)
    np.testing.assert_allclose(_launch_gated((x, w, ids, gate, up, None), None),
                               _gated_ref((x, w, ids, gate, up, None)), rtol=1e-5, atol=1e-5)


@needs_aot
@pytest.mark.parametrize("words", [False, True])
def test_aot_sm90_no_subword_loads(words, tmp_path, monkeypatch):
    """Gated Q4_K at decode tiles (16 x 32, 4 warps) for sm_90: the byte-read header leaves 4 ld.global.b16 and 12
    ld.global.b8 (synchronous: Triton's pipeliner skips loads under 4 bytes); read as words, none, and the header
    joins the quants in cp.async."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kern = dsl_launch.compile(moe_gguf.moe_qgemm_kernel, "triton", TOP_K=8, GATED=True, ACT="silu", QTYPE_A="Q4_K",
                              QTYPE_B="Q4_K", KB_A=1, KB_B=1, BLOCK_M=16, BLOCK_N=32, WIDE=True, PDL=True,
                              WORDS=words)
    sig = dict(x="*bf16", w_a="*u8", w_b="*u8", y="*bf16", rows="*i32", block_expert="*i32", weights="*fp32")
    kir = kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig})
    ptx = aot_compile(kir, arch=90, num_warps=4, num_stages=3, aligned=True).asm["ptx"]
    sub = re.findall(r"ld\.global(?:\.\w+)*\.[bsu](?:8|16)\b", ptx)
    assert "cp.async" in ptx
    assert (len(sub) == 0) if words else (len(sub) == 16), sub


def test_sweep_moe_variants_argument():
    """tools/sweep_moe --variants takes blocked and words only, and says so before touching a GPU."""
    from tools import sweep_moe

    with pytest.raises(SystemExit):
        sweep_moe.main(["--variants", "blocked,bytes"])
