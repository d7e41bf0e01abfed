"""The grouped GEMV of the MoE's GGUF passes (kernels_src/moe_gemv_grouped.py: slots aligned by expert, a program's
decoded rows dotted with a block of M slots' x) through moe.moe_experts(gemv="grouped") against the float64 reference
and against the per-slot GEMV, outputs poisoned first and rows padded with bytes that decode to NaN: Q4_K gate/up, Q6_K
down, Q5_K and Q8_0 stacks, gate and up of two formats, on routings that leave experts empty and that pile more than
M slots on one expert (several blocks); int8 x; a planted wrong expert that must fail; the switch's rule; the SIMT
lowering and Triton's interpreter; the sm_90 builds at Qwen3-30B-A3B's shapes (registers, no spills)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON
from test_kernels_moe_gemv import check_gguf, gguf_problem, run
from test_kernels_moe_gemv_i8 import i8_on, i8_ref  # noqa: F401 (a fixture)

from kernels_src import moe, moe_gemv, moe_gemv_grouped, moe_gguf


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def routed(args, ids):
    """args with the routing replaced by ids [T, k] (weights re-drawn to sum to 1 a token)."""
    x, _, _, *stacks = args
    w = np.random.default_rng(int(ids.sum())).random(ids.shape).astype(np.float32)
    return (x[:ids.shape[0]], w / w.sum(1, keepdims=True), ids.astype(np.int32), *stacks)


# 8 experts: tokens use only 0, 3 and 6 (the others' runs are empty: their blocks are padding only)
SPARSE = np.array([[0, 3], [6, 0], [3, 6], [0, 6], [3, 0]])
# 10 tokens all with expert 1 (10 slots: two blocks of 8), the other slot spread over 2, 5 and 7
PILED = np.array([[1, e] for e in (2, 5, 7, 2, 5, 7, 2, 5, 7, 2)])


def check_both(args, **kw):
    """Against the reference, and against the per-slot GEMV within fp32 rounding."""
    check_gguf("numpy", args, gemv="grouped", **kw)
    got, want = run("numpy", args, gemv="grouped", **kw), run("numpy", args, gemv=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtypes,hidden,inner,ids", [
    (("Q4_K", "Q4_K", None), 256, 8, SPARSE), (("Q4_K", "Q4_K", None), 256, 8, PILED),
    ((None, None, "Q6_K"), 8, 256, PILED), (("Q5_K", "Q5_K", None), 256, 8, SPARSE),
    (("Q8_0", "Q4_K", None), 256, 8, PILED), (("Q8_0", "Q8_0", "Q8_0"), 32, 32, SPARSE)],
    ids=["q4_k-sparse", "q4_k-piled", "q6_k-piled", "q5_k-sparse", "two_formats-piled", "q8_0-sparse"])
def test_formats(qtypes, hidden, inner, ids, rng):
    """Q4_K_M's gate/up (one loop for both) and down, each beside dense passes (the two together at the interpreter's
    shapes: ~35 s); Q5_K; Q8_0 gate beside Q4_K up (two loops); every pass Q8_0."""
    check_both(routed(gguf_problem(rng, 10, hidden, inner, 8, 2, qtypes), ids))


def test_block_m(rng):
    """Blocks of 4 slots (the sweep's other M): PILED's expert 1 then takes three blocks, the last of two slots."""
    check_both(routed(gguf_problem(rng, 10, 256, 8, 8, 2, ("Q4_K", "Q4_K", None)), PILED), block_m=4)


@pytest.mark.parametrize("qtypes,hidden,inner", [(("Q4_K", "Q4_K", None), 256, 8), ((None, None, "Q6_K"), 8, 256)])
def test_int8_x(qtypes, hidden, inner, rng, i8_on):  # noqa: F811
    """On int8 x (moe_gemv.I8 on, the interpreter an I8 target): Q4_K_M's gate/up and down passes, one quantize_x a
    GGUF pass, against the per-slot GEMV on int8 x (the same codes: fp32 rounding apart) and the float64 reference
    with x or h quantized as quantize_x_ref does."""
    args = routed(gguf_problem(rng, 10, hidden, inner, 8, 2, qtypes), PILED)
    got = np.asarray(run("numpy", args, gemv="grouped"), np.float64)
    assert i8_on == ([(10, hidden)] if qtypes[0] else [(20, inner)])
    per_slot = run("numpy", args, gemv=True)
    np.testing.assert_allclose(got, per_slot, rtol=2e-5, atol=2e-5 * np.abs(per_slot).max())
    want = i8_ref(*args, "silu", qtypes[0] is not None, qtypes[2] is not None)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-3 * np.abs(want).max())


def test_wrong_expert_fails(rng, monkeypatch):
    """A planted bug (each block reading the next expert's rows) is caught by the checks above."""
    args = routed(gguf_problem(rng, 10, 256, 8, 8, 2, ("Q4_K", "Q4_K", None)), SPARSE)
    align = moe.moe_align

    def shifted(ids, experts, block_m):
        rows, block_expert = align(ids, experts, block_m)
        return rows, (block_expert + 1) % experts

    monkeypatch.setattr(moe, "moe_align", shifted)
    with pytest.raises(AssertionError):
        check_gguf("numpy", args, gemv="grouped")


def test_the_switch(rng, monkeypatch):
    """Off by default; on, moe_experts takes it by itself over GGUF stacks in GROUPED_GEMV_SLOTS' range and no more
    than GROUPED_PER_EXPERT slots an expert, and never over dense stacks."""
    assert moe_gemv.GROUPED_GEMV is (os.environ.get("LLM_ENGINE_MOE_GROUPED_GEMV") == "1")
    lo, hi = moe_gemv.GROUPED_GEMV_SLOTS
    q = gguf_problem(rng, 1, 256, 256, 8, 2, ("Q4_K", "Q4_K", "Q6_K"))[3:]
    monkeypatch.setattr(moe_gemv, "GROUPED_GEMV", False)
    assert not moe_gemv.use_grouped_gemv(lo + 8, 128, q)
    monkeypatch.setattr(moe_gemv, "GROUPED_GEMV", True)
    assert moe_gemv.use_grouped_gemv(lo + 8, 128, q) and moe_gemv.use_grouped_gemv(hi, 128, q)
    assert not moe_gemv.use_grouped_gemv(lo, 128, q) and not moe_gemv.use_grouped_gemv(hi + 8, 256, q)
    assert not moe_gemv.use_grouped_gemv(lo + 8, 8, q)  # 17 slots an expert
    dense = [np.zeros(s.shape, np.float32) for s in q]
    assert not moe_gemv.use_grouped_gemv(lo + 8, 128, dense)
    calls = []
    monkeypatch.setattr(moe_gemv, "GROUPED_GEMV_SLOTS", (8, 32))  # small enough for the interpreter
    monkeypatch.setattr(moe_gemv_grouped, "run", lambda *a, **kw: calls.append(a[1].shape[0]))
    monkeypatch.setattr(moe_gemv, "run", lambda *a, **kw: calls.append("gemv"))
    x = np.zeros((9, 256), np.float32)
    ids, w = np.arange(18).reshape(9, 2) % 8, np.ones((9, 2), np.float32)
    moe.moe_experts(x, w, ids, *q)
    moe.moe_experts(x[:4], w[:4], ids[:4], *q)  # 8 slots: the per-slot GEMV
    assert calls == [18, "gemv"]


def test_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) on the CPU fiber oracle: Q4_K gate and up, then a Q8_0 down, 3 slots
    over 2 experts in blocks of 2 (expert 0 in two)."""
    ids = np.array([[0], [1], [0]])
    check_gguf("simt-cpu", routed(gguf_problem(rng, 3, 256, 4, 2, 1, ("Q4_K", "Q4_K", None)), ids), gemv="grouped",
               block_m=2)
    check_gguf("simt-cpu", routed(gguf_problem(rng, 3, 4, 32, 2, 1, (None, None, "Q8_0")), ids), gemv="grouped",
               block_m=2)


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
def test_triton_interpret(rng):
    """Every pass quantized (Q8_0 gate/up, Q4_0 down) on Triton's interpreter: 3 tokens over 4 experts, expert 1
    unused, expert 2 in two blocks of 2."""
    ids = np.array([[0, 2], [2, 3], [2, 0]])
    check_gguf("triton-interpret", routed(gguf_problem(rng, 3, 32, 32, 4, 2, ("Q8_0", "Q8_0", "Q4_0")), ids),
               gemv="grouped", block_m=2)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("gated,qtype,rows,int8", [(True, "Q4_K", 768, False), (True, "Q4_K", 768, True),
                                                   (False, "Q6_K", 2048, True)])
def test_aot_sm90(gated, qtype, rows, int8, tmp_path, monkeypatch):
    """Qwen3-30B-A3B's passes (Q4_K_M's formats) at the launcher's tiles (M = 8) on int8 x (as the launcher takes them
    from 64 slots), and the gated one on fp x, built for an H200: the grid dependency wait, 16-byte loads (on int8 x:
    dp4a), nothing spilled (104, 168 and 161 registers when written; the fp down pass: 145)."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    st = moe_gguf.GGUFStack(None, qtype, (128, rows, 2048 if gated else 768))
    consts = moe_gemv_grouped.tiles(st, st, gated) | dict(GATED=gated, I8=int8)
    warps = consts.pop("num_warps")
    entry = REGISTRY["moe_gemv_grouped"]
    sig = entry.signature | (dict(x="*i8") if int8 else {})
    kir = entry.kernel("triton", num_warps=warps, **consts).trace(signature=sig)
    compiled = aot_compile(kir, arch=90, aligned=True, num_warps=warps)
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ("dp4a" in ptx if int8 else "ld.global.v4" in ptx)
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
