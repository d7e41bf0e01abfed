"""The small-batch MoE (kernels_src/moe_gemv.py: a GEMV a slot, nothing grouped) through moe.moe_experts against the
float64 reference, outputs poisoned first: dense stacks on the DSL interpreter and Triton's, fp32 and fp16, ragged
top_k (2, 6, 8), up to GEMV_SLOTS slots, tokens sharing experts, K and N off the tiles; GGUF stacks of every format
moe_gguf takes, as gate/up and as down, on rows padded with bytes that decode to NaN, gate and up of one format (one
loop) and of two (two loops), dense passes beside quantized ones, and the tiles of 1024 rows or more; the rule that
picks the path (no alignment launched at all on it); the SIMT lowering on the CPU oracle; sm_90 AOT builds."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_moe import TOL, close, routing
from test_kernels_moe import problem as dense_problem
from test_kernels_moe_gguf import gguf_py_dense, on, stack

from kernels_src import dequant_gemv, moe, moe_gemv, moe_gguf

QTYPES = moe_gguf.QTYPES


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def no_grouping(monkeypatch):
    """Fails the test if moe_experts groups slots (moe_align) or launches the grouped kernels."""
    def refuse(*a, **kw):
        raise AssertionError("the GEMV path grouped slots by expert")

    monkeypatch.setattr(moe, "moe_align", refuse)
    monkeypatch.setattr(moe, "_grouped", refuse)


def aligned(w, pad: int = 16):
    """A GGUF stack's rows copied to 16-byte aligned rows with `pad` more 0xFF bytes past each (NaN if read)."""
    if not moe_gguf.is_blocks(w):
        return w
    n, rb = w.data.shape
    stride = -(-rb // 16) * 16 + pad
    raw = np.full((n + 2) * stride + 16, 0xFF, np.uint8)
    off = -raw.ctypes.data % 16
    big = raw[off:off + (n + 2) * stride].reshape(n + 2, stride)
    big[:n, :rb] = w.data
    return w._replace(data=big[:n, :rb])


def gguf_problem(rng, tokens, hidden, inner, experts, k, qtypes, dtype=np.float32):
    x = rng.standard_normal((tokens, hidden)).astype(dtype)
    ids, w = routing(rng, tokens, experts, k)
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    return (x, w, ids, *(aligned(stack(rng, q, experts, *s)) for q, s in zip(qtypes, shapes, strict=True)))


def run(target, args, act="silu", **kw):
    x, w, ids, *stacks = args
    out = dev(np.full(x.shape, np.nan, x.dtype), target)
    got = moe.moe_experts(*(dev(a, target) for a in (x, w, ids)), *(on(target, s) for s in stacks), act, out=out,
                          target=target, **kw)
    assert got is out
    return host(out)


def check_gguf(target, args, act="silu", tol=TOL[np.float32], **kw):
    x, w, ids, *stacks = args
    got = np.asarray(run(target, args, act, **kw), np.float64)
    assert np.isfinite(got).all(), "outputs left unwritten, or padding bytes read"
    want = moe.moe_experts_ref(x, w, ids, *(gguf_py_dense(s) for s in stacks), act)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


# Triton's interpreter runs every program in Python: wider dense tiles there keep the grid small
WIDE = {"numpy": {}, "triton-interpret": dict(block_n=64)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("tokens,k,experts,hidden", [(1, 8, 16, 72), (3, 6, 8, 300), (8, 8, 64, 72), (5, 2, 4, 40)])
def test_dense(target, dtype, tokens, k, experts, hidden, rng, no_grouping):
    """One token of top-8; 3 of top-6 over 8 experts (tokens share experts), K of 300 (two 256-wide steps, the
    second ragged); GEMV_SLOTS slots (8 of top-8); 10 slots over 4 experts (gemv forced past the rule). N of 40 and
    hidden rows off the 16-row tiles."""
    args = dense_problem(rng, tokens, hidden, 40, experts, k, dtype)
    act = "silu" if dtype == np.float32 else "gelu_tanh"
    got = run(target, args, act, gemv=True if tokens * k > experts else None, **WIDE[target])
    close(got, moe.moe_experts_ref(*args, act), TOL[dtype])


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_formats(qtype, rng, no_grouping):
    """Each format as gate and up (one loop for both) beside a dense down, then as down beside dense gate and up;
    3 tokens of top-2 over 4 experts (DSL interpreter)."""
    k = 256 if qtype.endswith("_K") else 64
    check_gguf("numpy", gguf_problem(rng, 3, k, 24, 4, 2, (qtype, qtype, None)), gemv=True)
    check_gguf("numpy", gguf_problem(rng, 3, 20, k, 4, 2, (None, None, qtype)), gemv=True)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtypes,hidden,inner", [(("Q4_K", "Q4_K", None), 256, 8), ((None, None, "Q6_K"), 8, 256),
                                                 (("Q8_0", "Q4_K", None), 256, 8), (("Q8_0", "Q8_0", "Q4_0"), 32, 32)])
def test_gguf(target, qtypes, hidden, inner, rng, no_grouping):
    """Q4_K gate/up in one loop; Q6_K down; Q8_0 gate and Q4_K up in two loops; all passes quantized. One token of
    top-2 (the decode step)."""
    check_gguf(target, gguf_problem(rng, 1, hidden, inner, 4, 2, qtypes))


def test_gguf_q4_k_m_fp16(rng, no_grouping):
    """Q4_K_M's stacks (Q4_K gate and up, Q6_K down), fp16 activations, gelu_tanh, one token of top-2."""
    check_gguf("numpy", gguf_problem(rng, 1, 256, 256, 4, 2, ("Q4_K", "Q4_K", "Q6_K"), np.float16), "gelu_tanh",
               TOL[np.float16])


@pytest.mark.parametrize("qtypes,hidden,inner", [(("Q8_0", "Q8_0", None), 32, 1027), (("Q8_0", "Q4_0", None), 32, 1027),
                                                 ((None, None, "Q8_0"), 1030, 32)])
def test_gguf_many_rows(qtypes, hidden, inner, rng, no_grouping):
    """1024 rows or more: dequant_gemv's 4 rows a program (2 in a fused gated pass, each row gate's and up's), the
    last program's rows clamped past N (1027 and 1030 are off both)."""
    args = gguf_problem(rng, 1, hidden, inner, 3, 1, qtypes)
    gated = qtypes[0] is not None
    a, b = (args[3], args[4]) if gated else (args[5], args[5])
    assert moe_gemv._gguf_tiles(a, b, gated)["ROWS"] == (2 if gated and qtypes[0] == qtypes[1] else 4)
    # Qwen3-30B-A3B's 768 gate / up rows: one a program alone, two (gated) over one token's 8 slots (6,144 rows in
    # the grid); its 2,048 down rows 4 either way
    gate, down = moe_gguf.GGUFStack(None, "Q4_K", (128, 768, 2048)), moe_gguf.GGUFStack(None, "Q6_K", (128, 2048, 768))
    assert [moe_gemv._gguf_tiles(gate, gate, True, slots)["ROWS"] for slots in (1, 8)] == [1, 2]
    assert [moe_gemv._gguf_tiles(down, down, False, slots)["ROWS"] for slots in (1, 8)] == [4, 4]
    check_gguf("numpy", args)


def test_the_rule(rng, monkeypatch):
    """moe_experts takes the GEMV at up to GEMV_SLOTS slots and no more slots than experts, over stacks whose rows
    it can read; otherwise the grouped kernels (and both give the reference)."""
    calls = []
    grouped = moe._grouped
    monkeypatch.setattr(moe, "_grouped", lambda *a: calls.append(a[7].shape[0]) or grouped(*a))
    for tokens, k, experts, want_grouped in [(8, 8, 64, False), (13, 5, 128, False), (17, 8, 128, True),
                                             (3, 3, 8, True), (2, 4, 8, False)]:
        args = dense_problem(rng, tokens, 16, 8, experts, k, np.float32)
        calls.clear()
        close(run("numpy", args), moe.moe_experts_ref(*args), TOL[np.float32])
        assert bool(calls) == want_grouped, (tokens, k, experts)
        assert moe_gemv.use_gemv(tokens * k, experts, args[3:]) != want_grouped
    assert moe_gemv.GEMV_SLOTS == 128
    # GGUF stacks take it to four times the experts (and GGUF_GEMV_SLOTS): 32 slots over 8 experts
    q = gguf_problem(rng, 3, 256, 256, 8, 4, ("Q4_K", "Q4_K", "Q4_K"))
    assert moe_gemv.use_gemv(32, 8, q[3:6]) and not moe_gemv.use_gemv(33, 8, q[3:6])
    assert not moe_gemv.use_gemv(moe_gemv.GGUF_GEMV_SLOTS + 8, 512, q[3:6])
    # Q4_K rows off a 16-byte boundary (the grouped kernels read them): grouped by default, refused when forced
    args = gguf_problem(rng, 1, 256, 16, 4, 2, ("Q4_K", "Q4_K", None))
    odd = args[:3] + tuple(stack(rng, "Q4_K", 4, 16, 256) for _ in range(2)) + args[5:]  # rows of 150 bytes
    assert not moe_gemv.stack_fits(odd[3]) and dequant_gemv.ALIGN["Q4_K"] == 16
    calls.clear()
    check_gguf("numpy", odd)
    assert calls
    with pytest.raises(ValueError, match="16-byte"):
        run("numpy", odd, gemv=True)


def test_simt_cpu(rng, no_grouping):
    """The SIMT lowering (Metal's and CUDA C's) on the CPU fiber oracle: dense at small tiles, then Q4_K gate and
    up with a Q8_0 down: one token of top-2."""
    args = dense_problem(rng, 2, 40, 24, 4, 2, np.float32)
    close(run("simt-cpu", args, block_n=16, block_k=32), moe.moe_experts_ref(*args), 1e-5)
    check_gguf("simt-cpu", gguf_problem(rng, 1, 256, 4, 2, 2, ("Q4_K", "Q4_K", None)))
    check_gguf("simt-cpu", gguf_problem(rng, 1, 4, 64, 2, 2, (None, None, "Q8_0")))


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("name,gated,qtypes,rows", [
    ("moe_gemv", True, None, 768), ("moe_gemv", False, None, 2048),
    ("moe_gemv_gguf", True, ("Q4_K", "Q4_K"), 768), ("moe_gemv_gguf", False, ("Q6_K", "Q6_K"), 2048),
    ("moe_gemv_gguf", True, ("Q5_K", "Q5_K"), 1408), ("moe_gemv_gguf", True, ("Q8_0", "Q4_K"), 768)])
def test_aot_sm90(name, gated, qtypes, rows, tmp_path, monkeypatch):
    """Qwen3-30B-A3B's passes (768 inner rows, 2048 hidden ones; Q4_K_M's formats) and DeepSeek-V2-Lite's gated one
    (1408 rows: 2 a program, each gate's and up's) at the launcher's tiles, with the JIT's specialization of those
    shapes (pointers, strides and sizes divisible by 16: the dense K mask then keeps 16-byte loads), build for an
    H200: the grid dependency wait, 16-byte loads, nothing spilled."""
    import triton
    from test_kernels_gemv import _stack_bytes
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry = REGISTRY[name]
    if qtypes is None:
        consts, warps = dict(GATED=gated), moe_gemv.DENSE_TILES["num_warps"]
    else:
        k = 2048 if gated else rows
        a, b = (moe_gguf.GGUFStack(None, q, (128, rows if gated else 2048, k)) for q in qtypes)
        consts = moe_gemv._gguf_tiles(a, b, gated) | dict(GATED=gated)
        warps = consts.pop("num_warps")
    kir = entry.kernel("triton", **consts).trace(signature=entry.signature)
    div16 = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kir.params) if p.name != "n_steps"}  # as the JIT
    fn = JITFunction(load_function(TritonRenderer().render(kir), kir.name))
    c = triton.compile(ASTSource(fn, signature=kir.signature, attrs=div16), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    ptx = c.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "ld.global.v4" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
