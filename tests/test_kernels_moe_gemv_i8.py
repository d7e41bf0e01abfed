"""The small-batch MoE's GGUF passes on int8 x (kernels_src/moe_gemv.py, I8: quantize_x, then dequant_gemv_i8's loads
and dp4a dots) through moe.moe_experts on the DSL interpreter (Triton's runs every program in Python: too slow here),
with the switch on and I8_TARGETS widened to it, as tests/test_cuda_x_int8.py does. Two references: the float64 one
with x and h quantized as quantize_x_ref does (all that int8 x changes; what is left is fp32 rounding, and a rare
rounding tie of h, far below a wrong expert, row or slot), and moe_experts_ref within int8 x's error (~1-2% of the
largest output here). Then the rule (off by default, Triton only, formats with an int8 path, per pass) and the sm_90
builds of both passes at Qwen3-30B-A3B's shapes."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON
from test_kernels_moe_gemv import gguf_problem, no_grouping, run  # noqa: F401 (a fixture)
from test_kernels_moe_gguf import gguf_py_dense

from ir.interpreter import KERNELS
from kernels_src import dequant_gemv_i8, moe, moe_gemv, moe_gguf
from kernels_src.dequant_gemv_i8 import dequantize_x, quantize_x_ref


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def i8_on(monkeypatch):
    """The switch on and the interpreter an I8 target; yields the rows each quantize_x launch quantized."""
    rows = []
    quantize = dequant_gemv_i8.quantize_x
    monkeypatch.setattr(moe_gemv, "I8", True)
    monkeypatch.setattr(dequant_gemv_i8, "I8_TARGETS", (*dequant_gemv_i8.I8_TARGETS, "numpy"))
    monkeypatch.setattr(dequant_gemv_i8, "quantize_x", lambda x, **kw: rows.append(x.shape) or quantize(x, **kw))
    return rows


def q8(v: np.ndarray, on: bool) -> np.ndarray:
    """v as the int8 path sees it: quantized per 32 and back (fp32), where its pass is int8."""
    return dequantize_x(*quantize_x_ref(v)).astype(np.float64) if on else v


def i8_ref(x, w, ids, gate, up, down, act, gated_i8: bool, down_i8: bool):
    """moe_experts_ref with x quantized before the gated pass and h (in fp32, the routing weight in it, as the
    kernel stores it) before the down pass, where those passes are int8."""
    gate, up, down = (gguf_py_dense(s) for s in (gate, up, down))
    xq = q8(np.asarray(x, np.float32), gated_i8)
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            h = w[t, j] * KERNELS[act](gate[e] @ xq[t]) * (up[e] @ xq[t])
            out[t] += down[e] @ q8(h.astype(np.float32)[None], down_i8)[0]
    return out


@pytest.mark.parametrize("qtypes,launches", [(("Q4_K", "Q4_K", "Q6_K"), 2), (("Q6_K", "Q6_K", "Q4_K"), 2),
                                             (("Q8_0", "Q8_0", "Q6_K"), 1), (("Q4_K", "Q4_K", None), 1)])
def test_int8_x(qtypes, launches, rng, i8_on, no_grouping):  # noqa: F811
    """Q4_K_M's passes (Q4_K gate and up in one loop, Q6_K down) and the formats swapped: 2 tokens of top-2 over 4
    experts (each slot's x row and expert), hidden and inner 256; then a pass without an int8 path beside one with
    (Q8_0 gate and up: fp x; a dense down: the plain GEMV), each pass deciding for itself."""
    args = gguf_problem(rng, 2, 256, 256, 4, 2, qtypes)
    x, w, ids, *stacks = args
    got = np.asarray(run("numpy", args), np.float64)
    assert len(i8_on) == launches  # one quantize_x a pass that took the int8 path: x [T, H], then h [S, I]
    gated_i8, down_i8 = qtypes[0] in ("Q4_K", "Q6_K"), qtypes[2] in ("Q4_K", "Q6_K")
    assert i8_on == [(2, 256)] * gated_i8 + [(4, 256)] * down_i8
    want = i8_ref(x, w, ids, *stacks, "silu", gated_i8, down_i8)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-3 * scale)
    exact = moe.moe_experts_ref(x, w, ids, *(gguf_py_dense(s) for s in stacks))
    np.testing.assert_allclose(got, exact, rtol=0, atol=5e-2 * np.abs(exact).max())
    wrong = i8_ref(x, w, ids[:, ::-1].copy(), *stacks, "silu", gated_i8, down_i8)  # slots' experts swapped
    assert np.abs(wrong - want).max() > 30 * 3e-3 * scale  # what the tolerance would catch


def test_the_switch(monkeypatch):
    """By default from I8_MIN_SLOTS slots (LLM_ENGINE_MOE_I8 unset); on, only on I8_TARGETS (Triton) and over GGUF
    stacks of formats with an int8 path."""
    q4, q8_0, q6 = (moe_gguf.GGUFStack(None, q, (8, 256, 256)) for q in ("Q4_K", "Q8_0", "Q6_K"))
    dense = np.zeros((8, 256, 256), np.float32)
    assert moe_gemv.I8 == {"1": True, "0": False}.get(os.environ.get("LLM_ENGINE_MOE_I8", ""))
    monkeypatch.setattr(moe_gemv, "I8", None)  # the slot rule
    least = moe_gemv.I8_MIN_SLOTS
    assert moe_gemv.uses_i8("triton", q4, q4, slots=least) and not moe_gemv.uses_i8("triton", q4, q4, slots=least - 1)
    assert not moe_gemv.uses_i8("numpy", q4, q4, slots=least)
    monkeypatch.setattr(moe_gemv, "I8", False)
    assert not moe_gemv.uses_i8("triton", q4, q4, slots=10**6)
    assert not moe_gemv.uses_i8("triton", q4, q4)
    monkeypatch.setattr(moe_gemv, "I8", True)
    assert dequant_gemv_i8.I8_TARGETS == ("triton",)
    assert moe_gemv.uses_i8("triton", q4, q4, slots=1) and moe_gemv.uses_i8("triton", q6, q6)
    assert not moe_gemv.uses_i8("numpy", q4, q4) and not moe_gemv.uses_i8("simt-cpu", q6, q6)
    assert not moe_gemv.uses_i8("triton", q8_0, q8_0) and not moe_gemv.uses_i8("triton", q4, q8_0)
    assert not moe_gemv.uses_i8("triton", dense, dense)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("gated,qtype,rows", [(True, "Q4_K", 768), (False, "Q6_K", 2048), (False, "Q4_K", 2048)])
def test_aot_sm90(gated, qtype, rows, tmp_path, monkeypatch):
    """Qwen3-30B-A3B's passes on int8 x at the launcher's tiles, built for an H200: the grid dependency wait, dp4a,
    nothing spilled."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    st = moe_gguf.GGUFStack(None, qtype, (128, rows, 2048 if gated else 768))
    consts = moe_gemv._gguf_tiles(st, st, gated) | dict(GATED=gated, I8=True)
    warps = consts.pop("num_warps")
    entry = REGISTRY["moe_gemv_gguf"]
    kir = entry.kernel("triton", num_warps=warps, **consts).trace(signature=entry.signature | dict(x="*i8"))
    compiled = aot_compile(kir, arch=90, aligned=True, num_warps=warps)
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "dp4a" in ptx
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
