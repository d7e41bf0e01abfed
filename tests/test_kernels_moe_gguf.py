"""The fused MoE over GGUF expert stacks (kernels_src/moe_gguf.py, through moe.moe_experts) against the float64
dense reference on stacks decoded by gguf-py's dequantizer, independent of ours: Q8_0 and the 32-element legacy
formats packed by gguf-py's quantizer, the k-quants as random valid blocks (gguf-py cannot quantize to them). The DSL
interpreter and Triton's interpreter, Q4_K, Q5_K, Q6_K and Q8_0 stacks, a Q4_K_M-style mix (Q6_K down), gate and
up of different block sizes, dense and quantized passes together, one token and many crowding some experts past a
block while others get none, the prefill's tall tiles; rows read through views whose padding decodes to NaN;
outputs poisoned first. Then the SIMT lowering on the CPU oracle and sm_90 AOT builds without spills."""

from __future__ import annotations

import os
import zlib

import gguf
import numpy as np
import pytest
from test_gguf_quants import random_raw
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_moe import routing

from ir.formats.gguf_quants import row_bytes
from kernels_src import moe, moe_gguf

TOL = {np.float32: 1e-5, np.float16: 3e-3}  # of the largest output
PACKED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf-py quantizes these
# fp16 scale fields of the random k-quant blocks: weights of about 1 / sqrt(256) (so fp16 activations stay far from
# overflow through the gated product)
RANDOM_SCALE = {"Q2_K": 1e-3, "Q3_K": 2e-3, "Q4_K": 5e-4, "Q5_K": 2.5e-4, "Q6_K": 1.2e-4}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def stack(rng, qtype: str | None, experts: int, out: int, k: int):
    """An expert stack [experts, out, k]: dense fp32 (qtype None), else GGUF blocks [experts * out, row_bytes] as a
    view into rows padded with 0xFF bytes (6 past each row, 2 rows past the last), which decode to NaN if read."""
    if qtype is None:
        return (rng.standard_normal((experts, out, k)) / k ** 0.5).astype(np.float32)
    n, rb = experts * out, row_bytes(qtype, k)
    if qtype in PACKED:
        blocks = gguf.quants.quantize((rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32),
                                      gguf.GGMLQuantizationType[qtype])
    else:
        blocks = random_raw(qtype, (n, k), rng, RANDOM_SCALE[qtype]).reshape(n, rb)
    big = np.full((n + 2, rb + 6), 0xFF, np.uint8)
    big[:n, :rb] = blocks
    return moe_gguf.GGUFStack(big[:n, :rb], qtype, (experts, out, k))


def gguf_py_dense(w) -> np.ndarray:
    """A stack as float64, GGUF blocks decoded by gguf-py."""
    if not moe_gguf.is_blocks(w):
        return np.asarray(w, np.float64)
    data = np.ascontiguousarray(w.data)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[w.qtype]).reshape(w.shape).astype(np.float64)


def problem(rng, tokens, hidden, inner, experts, k, qtypes, dtype=np.float32, crowd=False):
    """(x, weights, ids, gate, up, down) with the stacks of qtypes (gate, up, down)."""
    x = rng.standard_normal((tokens, hidden)).astype(dtype)
    ids, w = routing(rng, tokens, experts, k, crowd)
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    return (x, w, ids, *(stack(rng, q, experts, *s) for q, s in zip(qtypes, shapes, strict=True)))


def on(target, w):
    if not moe_gguf.is_blocks(w):
        return dev(w, target)
    return moe_gguf.GGUFStack(dev(w.data, target), w.qtype, w.shape)


def check(target, args, act="silu", tol=TOL[np.float32], **kw):
    """The grouped GGUF kernels, at few slots too (the GEMV path: tests/test_kernels_moe_gemv.py) and at many (the
    dequantize-then-dense path moe_experts takes there by default: tests/test_kernels_moe_dequant.py, dequant=True)."""
    x, w, ids, *stacks = args
    out = dev(np.full(x.shape, np.nan, x.dtype), target)
    got = moe.moe_experts(*(dev(a, target) for a in (x, w, ids)), *(on(target, s) for s in stacks), act, out=out,
                          target=target, **{"gemv": False, "dequant": False, "mmq": False} | kw)
    assert got is out
    got = np.asarray(host(out), np.float64)
    want = moe.moe_experts_ref(x, w, ids, *(gguf_py_dense(s) for s in stacks), act)
    assert np.isfinite(got).all(), "outputs left unwritten, or padding bytes read"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


# Triton's interpreter runs every program in Python: there whole 256-wide rows a program keep the grid small (the
# tile rule's narrower tiles, and rows clamped past N, run on the DSL interpreter, which traces the same program,
# and on Triton's in test_moe_gguf_ragged)
WIDE_N = {"numpy": {}, "triton-interpret": dict(block_n=256)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("tokens,crowd", [(1, False), (24, True)])
def test_moe_gguf(target, qtype, tokens, crowd, rng):
    """One token (2 of 4 experts empty, every other block padding) and 24 crowding two experts into 2 blocks or more
    each; K of 256 (one super-block, 8 Q8_0 blocks)."""
    args = problem(rng, tokens, 256, 256, 4, 2, (qtype,) * 3, crowd=crowd)
    check(target, args, **WIDE_N[target])


@pytest.mark.parametrize("target", TARGETS)
def test_moe_gguf_q4_k_m_fp16(target, rng):
    """Q4_K_M's expert stacks (gate and up Q4_K, down Q6_K), fp16 activations, gelu_tanh, 7 tokens."""
    args = problem(rng, 7, 256, 512, 4, 2, ("Q4_K", "Q4_K", "Q6_K"), np.float16)
    check(target, args, "gelu_tanh", TOL[np.float16], **WIDE_N[target])


@pytest.mark.parametrize("qtypes", [("Q8_0", "Q4_K", "Q5_K"), (None, None, "Q6_K"), ("Q6_K", "Q6_K", None),
                                    ("Q4_0", "Q4_1", "Q2_K"), ("Q5_0", "Q5_1", "Q3_K")])
def test_moe_gguf_mixed_stacks(qtypes, rng):
    """Gate and up of different block sizes (8 Q8_0 blocks a step against one Q4_K), dense passes beside quantized
    ones, and the other six formats the decoders take (DSL interpreter)."""
    args = problem(rng, 5, 256, 256, 5, 3, qtypes, crowd=True)
    check("numpy", args)


@pytest.mark.parametrize("target", TARGETS)
def test_moe_gguf_ragged(target, rng):
    """Q8_0, N off the tiles (hidden 160, inner 96): rows past N clamped, not stored; the down pass's 3 blocks a row
    one a step. The tile rule's 16 x 16 decode tiles on the DSL interpreter, 64-wide ones (2 and 3 of them) on
    Triton's."""
    args = problem(rng, 3, 160, 96, 4, 2, ("Q8_0",) * 3)
    assert moe_gguf.step_blocks(("Q8_0",), 96) == [1] and moe.default_tiles(6, 4) == (16, 16)
    check(target, args, **({} if target == "numpy" else dict(block_n=64)))


def test_moe_gguf_prefill_tiles(rng):
    """96 tokens over 3 experts: 64 slots a block (moe.default_tiles' prefill rule), Q8_0 gate/up, Q4_K down."""
    args = problem(rng, 96, 256, 256, 3, 2, ("Q8_0", "Q8_0", "Q4_K"))
    assert moe.default_tiles(96 * 2, 3)[0] == 64
    check("numpy", args)


def test_our_reference_decodes_as_gguf_py(rng):
    """moe_experts_ref on GGUF stacks (our dequantizer, what the GPU cases compare with) equals the dense reference
    on gguf-py's decoding."""
    x, w, ids, *stacks = problem(rng, 5, 256, 256, 4, 2, ("Q4_K", "Q5_K", "Q6_K"))
    np.testing.assert_allclose(moe.moe_experts_ref(x, w, ids, *stacks),
                               moe.moe_experts_ref(x, w, ids, *(gguf_py_dense(s) for s in stacks)), rtol=1e-12)


def test_step_blocks():
    assert moe_gguf.step_blocks(("Q8_0", "Q4_K"), 512) == [8, 1]  # a super-block's 256 elements a step for both
    assert moe_gguf.step_blocks(("Q8_0", "Q8_0"), 512) == [4, 4]
    assert moe_gguf.step_blocks(("Q4_0",), 96) == [1]  # 3 blocks: steps of one
    assert moe_gguf.step_blocks(("Q6_K",), 768) == [1]


def test_bad_gguf_stacks_are_refused(rng):
    x, w, ids, gate, up, down = problem(rng, 2, 256, 256, 4, 2, ("Q4_K", "Q4_K", "Q6_K"))
    with pytest.raises(ValueError, match="both be dense or both GGUF"):
        moe.moe_experts(x, w, ids, gguf_py_dense(gate).astype(np.float32), up, down)
    with pytest.raises(ValueError, match="down: Q6_K stack"):
        moe.moe_experts(x, w, ids, gate, up, down._replace(data=down.data[:-1]))
    with pytest.raises(ValueError, match="unsupported qtype"):
        moe.moe_experts(x, w, ids, gate, up, down._replace(qtype="IQ2_XS"))
    with pytest.raises(ValueError, match="2-byte aligned"):
        moe.moe_experts(x, w, ids, gate, up, down._replace(data=np.empty((1024, 212), np.uint8)[:, 1:211]))
    odd = problem(rng, 2, 96, 256, 4, 2, ("Q8_0", "Q8_0", None))  # 96 columns: no Q4_K row
    with pytest.raises(ValueError, match="gate: Q4_K stack"):
        moe.moe_experts(*odd[:3], stack(rng, "Q4_K", 4, 256, 256)._replace(shape=(4, 256, 96)), *odd[4:])


def test_moe_gguf_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) on the CPU fiber oracle: Q4_K gate/up (its narrow decoding), Q8_0
    down, at small tiles: one token through both experts."""
    args = problem(rng, 1, 256, 64, 2, 2, ("Q4_K", "Q4_K", "Q8_0"))
    check("simt-cpu", args, block_n=64)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("gated,qtype,slots", [(True, "Q4_K", 16), (False, "Q6_K", 16), (True, "Q5_K", 300),
                                               (True, "Q6_K", 4096)])
def test_aot_sm90(gated, qtype, slots, tmp_path, monkeypatch):
    """The launcher's tiles and warps for decode (16 slots), mid-size (300) and prefill (4096 slots of 16 experts)
    batches build for an H200 with the JIT's 16-byte specialization: tensor-core MMAs, the grid dependency wait,
    nothing spilled."""
    import triton
    from test_kernels_gemv import _stack_bytes
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    block_m, block_n = moe.default_tiles(slots, 16)
    block_n, warps = moe_gguf.pass_tiles((qtype,), gated, block_m, block_n)
    kb = moe_gguf.step_blocks((qtype,), 2048)[0]
    entry = REGISTRY["moe_gemm_gguf"]
    kern = entry.kernel("triton", GATED=gated, QTYPE_A=qtype, QTYPE_B=qtype, KB_A=kb, KB_B=kb, BLOCK_M=block_m,
                        BLOCK_N=block_n)
    kir = kern.trace(signature=entry.signature)
    aligned = ("x", "w_a", "w_b", "y", "rows", "block_expert", "weights", "x_stride", "a_stride", "b_stride",
               "y_stride")
    div16 = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kir.params) if p.name in aligned}
    fn = JITFunction(load_function(TritonRenderer().render(kir), kir.name))
    c = triton.compile(ASTSource(fn, signature=kir.signature, attrs=div16), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 3})
    ptx = c.asm["ptx"]
    assert ("wgmma.mma_async" in ptx or "mma.sync" in ptx) and "griddepcontrol.wait" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
