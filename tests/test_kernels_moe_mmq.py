"""The fused MoE's grouped passes on int8 tensor cores (kernels_src/moe_mmq.py) over Q4_K / Q6_K expert stacks of
random valid blocks, outputs poisoned first. Each pass alone (moe_mmq.launch) against float64 with its input
quantized as the pre-pass does (gguf_mmq_sb.quantize_x256_ref, bit-exact) and W decoded by our numpy dequantizer:
tight, so a wrong expert, slot, scale or nibble fails (planted below); Q4_K_M's formats and the two swapped; one
token (most experts empty, most blocks padding) and tokens crowding two experts past a block; 32-slot blocks (Q4_K's
minimums by MMA). Then moe.moe_experts(mmq=True) end to end against moe_experts_ref within a bound built from
int8_error_bound(.., group=256) through both passes; the rule and the switch; Triton's interpreter; the sm_90 builds
of Qwen3-30B-A3B's passes (no spills)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, dev, host
from test_kernels_moe_gemv import aligned
from test_kernels_moe_gguf import problem

from ir.interpreter import KERNELS
from kernels_src import gguf_mmq_sb as sb
from kernels_src import moe, moe_gguf, moe_mmq
from kernels_src.dequant_gemv_i8 import int8_error_bound
from kernels_src.dsl import launch as dsl_launch

Q4_K_M = ("Q4_K", "Q4_K", "Q6_K")
SWAPPED = ("Q6_K", "Q6_K", "Q4_K")
TOL = 2e-5  # of the largest output: fp32 rounding of exact integer sums times their scales


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def mmq_problem(rng, tokens, qtypes, crowd=False, hidden=512, inner=256, experts=4, k=2):
    """(x, weights, ids, gate, up, down): stacks in 16-byte aligned rows with 0xFF padding (NaN if read)."""
    x, w, ids, *stacks = problem(rng, tokens, hidden, inner, experts, k, qtypes, crowd=crowd)
    return (x, w, ids, *(aligned(s) for s in stacks))


def q256(v) -> np.ndarray:
    """v as the pre-pass hands it to the MMAs: int8 per 256 elements and back, in float64."""
    q, d = sb.quantize_x256_ref(np.asarray(v, np.float32))
    return (q.reshape(q.shape[0], -1, 256).astype(np.float64) * d[..., None]).reshape(q.shape)


def dense(w) -> np.ndarray:
    return moe_gguf.dequantize_stack(w).astype(np.float64)


def run_pass(target, src, a, b, ids, w, gated, block_m=moe_mmq.BLOCK_M, block_n=None, loop_stages=None):
    """One pass through moe_mmq.launch on moe_align's layout: dst [S, n_cols], poisoned first."""
    experts, n_cols = a.shape[:2]
    k = ids.shape[1]
    s = ids.size
    rows, block_expert = moe.moe_align(ids, experts, block_m)
    dst = dev(np.full((s, n_cols), np.nan, np.float32), target)
    on = [moe_gguf.GGUFStack(dev(np.ascontiguousarray(m.data) if target != "numpy" else m.data, target), m.qtype,
                             m.shape) for m in (a, b)]
    moe_mmq.launch(dev(src, target), on[0], on[1], dst, dev(rows, target), dev(block_expert, target),
                   dev(w.reshape(-1), target), s, gated=gated, top_k=k, act="silu", block_m=block_m, target=target,
                   pdl=False, block_n=block_n, loop_stages=loop_stages)
    got = np.asarray(host(dst), np.float64)
    assert np.isfinite(got).all(), "slots left unwritten (NaN), or padding bytes read"
    return got


def gated_ref(x, ids, gate, up):
    """h [S, I] by slot: act(G[e] @ xq[tok]) * (U[e] @ xq[tok]), x quantized as the pre-pass does."""
    xq, g, u = q256(x), dense(gate), dense(up)
    tok = np.arange(ids.size) // ids.shape[1]
    e = ids.reshape(-1)
    return KERNELS["silu"](np.einsum("sih,sh->si", g[e], xq[tok])) * np.einsum("sih,sh->si", u[e], xq[tok])


def down_ref(h, ids, w, down):
    """y [S, H] by slot: weights[slot] * D[e] @ hq[slot]."""
    return w.reshape(-1, 1) * np.einsum("shi,si->sh", dense(down)[ids.reshape(-1)], q256(h))


def close(got, want, tol=TOL):
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


CASES = [(Q4_K_M, 1, False), (Q4_K_M, 24, True), (SWAPPED, 24, True), (SWAPPED, 3, False)]


@pytest.mark.parametrize("qtypes,tokens,crowd", CASES)
def test_passes(qtypes, tokens, crowd, rng):
    """DSL interpreter, hidden 512 and inner 256 (2 and 1 super-blocks), 4 experts of top 2: one token (2 experts
    empty), 24 crowding two experts into 2-3 blocks each, the gated pass's 256 rows in 4 tiles of 64."""
    x, w, ids, gate, up, down = mmq_problem(rng, tokens, qtypes, crowd)
    if crowd:
        assert np.bincount(ids.ravel(), minlength=4).max() > moe_mmq.BLOCK_M  # several blocks of one expert
    close(run_pass("numpy", x, gate, up, ids, w, True), gated_ref(x, ids, gate, up))
    h = rng.standard_normal((ids.size, 256)).astype(np.float32)
    close(run_pass("numpy", h, down, down, ids, w, False), down_ref(h, ids, w, down))


def test_gate_and_up_of_two_formats_and_tall_blocks(rng):
    """Gate Q4_K beside up Q6_K in one loop, then both passes at 32-slot blocks (Q4_K's minimums through the split
    sums' fp16 MMAs); hidden 768: the down pass's second 512-row tile ragged (rows clamped, not stored)."""
    x, w, ids, gate, _, down = mmq_problem(rng, 20, Q4_K_M, crowd=True, hidden=768)
    up = mmq_problem(rng, 1, SWAPPED, hidden=768)[3]
    close(run_pass("numpy", x, gate, up, ids, w, True), gated_ref(x, ids, gate, up))
    close(run_pass("numpy", x, gate, up, ids, w, True, block_m=32, block_n=32), gated_ref(x, ids, gate, up))
    h = rng.standard_normal((ids.size, 256)).astype(np.float32)
    close(run_pass("numpy", h, down, down, ids, w, False, block_m=32, block_n=512), down_ref(h, ids, w, down))


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
@pytest.mark.parametrize("qtypes", [Q4_K_M, SWAPPED])
def test_passes_triton_interpreter(qtypes, rng):
    """Triton's interpreter (every program in Python: whole 256-row tiles keep the grid small)."""
    x, w, ids, gate, up, down = mmq_problem(rng, 5, qtypes, crowd=True)
    close(run_pass("triton-interpret", x, gate, up, ids, w, True, block_n=256), gated_ref(x, ids, gate, up))
    h = rng.standard_normal((ids.size, 256)).astype(np.float32)
    close(run_pass("triton-interpret", h, down, down, ids, w, False, block_n=256), down_ref(h, ids, w, down))


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
def test_loop_stages_change_no_number(rng):
    """The K loop pipelined (loop_stages, LLM_ENGINE_MMQ_LOOP_STAGES) gives the plain loop's numbers, bit for bit,
    through Triton's own source (the interpreter), in both passes."""
    x, w, ids, gate, up, down = mmq_problem(rng, 5, Q4_K_M, crowd=True)
    runs = [run_pass("triton-interpret", x, gate, up, ids, w, True, block_n=256, loop_stages=st) for st in (0, 2)]
    np.testing.assert_array_equal(runs[1], runs[0])
    h = rng.standard_normal((ids.size, 256)).astype(np.float32)
    runs = [run_pass("triton-interpret", h, down, down, ids, w, False, block_n=256, loop_stages=st) for st in (0, 2)]
    np.testing.assert_array_equal(runs[1], runs[0])
    close(runs[0], down_ref(h, ids, w, down))


def test_passes_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) on the CPU fiber oracle: one token through two experts, Q4_K_M."""
    x, w, ids, gate, up, down = mmq_problem(rng, 1, Q4_K_M, hidden=256)
    close(run_pass("simt-cpu", x, gate, up, ids, w, True, block_n=64), gated_ref(x, ids, gate, up))
    h = rng.standard_normal((ids.size, 256)).astype(np.float32)
    close(run_pass("simt-cpu", h, down, down, ids, w, False, block_n=64), down_ref(h, ids, w, down))


_words = sb._scale_words


def _swap_sub_blocks(words):
    s = _words(words)
    return (s[1], s[0], s[2], s[3])  # sub-blocks 0-3's scales for 4-7's


def _next_expert(*args):
    from kernels_src.moe_slots import block_slots

    e, *rest = block_slots(*args)
    return ((e + 1) % 4, *rest)


PLANTED = {  # a bug -> how it is planted (gated pass, Q4_K gate / up)
    "wrong expert offset": lambda mp: mp.setattr(moe_mmq, "block_slots", _next_expert),
    "sub-block scales swapped": lambda mp: mp.setattr(sb, "_scale_words", _swap_sub_blocks),
    "high nibbles' offset left out": lambda mp: mp.setattr(sb, "_high_nibbles", lambda v: v & 0xF0),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_fails(bug, rng, monkeypatch):
    x, w, ids, gate, up, _ = mmq_problem(rng, 6, Q4_K_M)
    want = gated_ref(x, ids, gate, up)
    monkeypatch.setattr(dsl_launch, "_kernels", {})  # traced afresh with the bug, forgotten after
    monkeypatch.setattr(dsl_launch, "_compiled", {})
    PLANTED[bug](monkeypatch)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(run_pass("numpy", x, gate, up, ids, w, True), want)


def e2e_bound(x, w, ids, gate, up, down) -> np.ndarray:
    """|out - moe_experts_ref| allowed [T, H]: x's quantization moves gate and up by at most int8_error_bound(..,
    group=256) each, hence h by |silu'| <= 1.1 times the first (times |up|) plus |silu(g)| times the second; h's own
    quantization (its step from max(|h| + dh)) and dh then go through |D[e]|, times the routing weight."""
    n = gate.shape[1]
    out = np.zeros((x.shape[0], down.shape[1]))
    g_all, u_all, d_all = dense(gate), dense(up), dense(down)
    for t in range(x.shape[0]):
        xt = x[t:t + 1]
        for j, e in enumerate(ids[t]):
            bg, bu = (int8_error_bound(xt, st.data[e * n:(e + 1) * n], st.qtype, 256)[0] for st in (gate, up))
            g, u = g_all[e] @ xt[0].astype(np.float64), u_all[e] @ xt[0].astype(np.float64)
            dh = 1.1 * bg * (np.abs(u) + bu) + np.abs(KERNELS["silu"](g)) * bu
            h_hi = (np.abs(KERNELS["silu"](g) * u) + dh)[None].astype(np.float32)
            rows = down.data[e * down.shape[1]:(e + 1) * down.shape[1]]
            out[t] += w[t, j] * (np.abs(d_all[e]) @ dh + int8_error_bound(h_hi, rows, down.qtype, 256)[0])
    return out


@pytest.mark.parametrize("qtypes", [Q4_K_M, SWAPPED])
def test_moe_experts_end_to_end(qtypes, rng):
    """moe_experts(mmq=True), numpy: close to moe_mmq_ref (x and h quantized as the pre-passes do; a rare rounding
    tie of h aside), where the slots' experts swapped are far off; against the float64 reference on unquantized x
    within e2e_bound (a worst case: every element's rounding at its step's half, all of one sign) and, as measured,
    within 1-5% of the largest output (8% allowed)."""
    x, w, ids, *stacks = args = mmq_problem(rng, 7, qtypes, crowd=True)
    got = np.asarray(moe.moe_experts(*args, gemv=False, mmq=True), np.float64)
    ref = moe_mmq.moe_mmq_ref(*args)
    close(got, ref, 1e-4)
    wrong = moe_mmq.moe_mmq_ref(x, w, ids[:, ::-1].copy(), *stacks)
    assert np.abs(wrong - ref).max() > 100 * 1e-4 * np.abs(ref).max()
    want = moe.moe_experts_ref(*args)
    assert (np.abs(got - want) <= e2e_bound(x, w, ids, *stacks) + TOL * np.abs(want).max()).all()
    assert np.abs(got - want).max() < 0.08 * np.abs(want).max()


def test_moe_experts_fp16(rng):
    """fp16 activations: h stored in fp16 by the gated pass, then quantized (moe_mmq_ref rounds it alike); the
    output's fp16 rounding (2**-11) is what is left."""
    x, w, ids, *stacks = mmq_problem(rng, 7, Q4_K_M, crowd=True)
    x = x.astype(np.float16)
    got = moe.moe_experts(x, w, ids, *stacks, gemv=False, mmq=True)
    assert got.dtype == np.float16
    close(np.asarray(got, np.float64), moe_mmq.moe_mmq_ref(x, w, ids, *stacks, h_dtype="float16"), 3e-3)


def test_the_rule_and_the_switch(rng, monkeypatch):
    """On unless LLM_ENGINE_MOE_MMQ=0; on, below MMQ_SLOTS_PER_EXPERT slots an expert. A pass goes here only over
    Q4_K / Q6_K blocks of whole super-blocks (Q4_K rows 4-byte aligned); the others keep their path."""
    assert moe_mmq.MMQ == (os.environ.get("LLM_ENGINE_MOE_MMQ", "1") == "1")
    monkeypatch.setattr(moe_mmq, "MMQ", True)
    bound = moe_mmq.MMQ_SLOTS_PER_EXPERT * 128
    assert moe_mmq.use_mmq(bound - 1, 128) and not moe_mmq.use_mmq(bound, 128)
    q4 = moe_gguf.GGUFStack(np.zeros((8, 288), np.uint8), "Q4_K", (4, 2, 512))
    least = moe_mmq.MMQ_MIN_SLOTS
    assert moe_mmq.over_gemv(least, q4, q4, 512) and not moe_mmq.over_gemv(least - 1, q4, q4, 512)
    assert not moe_mmq.over_gemv(least, q4, q4._replace(qtype="Q5_K"), 512)
    monkeypatch.setattr(moe_mmq, "MMQ", False)
    assert not moe_mmq.use_mmq(1, 128) and not moe_mmq.over_gemv(10**6, q4, q4, 512)
    q4, q6 = (moe_gguf.GGUFStack(np.zeros((8, rb), np.uint8), q, (4, 2, 512)) for q, rb in (("Q4_K", 288),
                                                                                            ("Q6_K", 420)))
    q8 = moe_gguf.GGUFStack(np.zeros((8, 544), np.uint8), "Q8_0", (4, 2, 512))
    assert moe_mmq.takes(q4, q6, True, 512) and moe_mmq.takes(q6, q6, False, 512)
    assert not moe_mmq.takes(q4, q8, True, 512) and not moe_mmq.takes(np.zeros((4, 2, 512)), None, False, 512)
    assert not moe_mmq.takes(q4._replace(data=np.zeros((8, 290), np.uint8)[:, 2:]), q4, True, 512)  # unaligned
    assert moe_mmq.takes(q6._replace(data=np.zeros((8, 422), np.uint8)[:, 2:]), None, False, 512)  # Q6_K: 2 will do
    assert not moe_mmq.takes(q4, q4, True, 384)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the spied GEMV leaves y unwritten
def test_the_switch_takes_steps_from_the_gemv(rng, monkeypatch):
    """On, a step of MMQ_MIN_SLOTS slots or more that the GEMV rule would take runs here (both passes); fewer keep
    the GEMV (spied on, not run); gemv=True still forces it."""
    calls = []
    launch = moe_mmq.launch
    monkeypatch.setattr(moe_mmq, "launch", lambda *a, **kw: calls.append(kw["gated"]) or launch(*a, **kw))
    monkeypatch.setattr(moe.moe_gemv, "run", lambda *a, **kw: calls.append("gemv"))
    monkeypatch.setattr(moe_mmq, "MMQ", True)
    monkeypatch.setattr(moe_mmq, "MMQ_MIN_SLOTS", 8)
    args = mmq_problem(rng, 4, Q4_K_M)  # 8 slots over 4 experts: the GEMV's by its rule
    assert moe.moe_gemv.use_gemv(8, 4, args[3:])
    close(moe.moe_experts(*args), moe_mmq.moe_mmq_ref(*args), 1e-4)
    assert calls == [True, False]
    moe.moe_experts(*args, gemv=True)
    monkeypatch.setattr(moe_mmq, "MMQ_MIN_SLOTS", 9)
    moe.moe_experts(*args)
    assert calls == [True, False, "gemv", "gemv"]


def test_moe_experts_routes_each_pass(rng, monkeypatch):
    """With mmq=True, Q8_0 gate / up keep the grouped GGUF kernel and only the Q6_K down pass comes here."""
    calls = []
    launch = moe_mmq.launch
    monkeypatch.setattr(moe_mmq, "launch", lambda *a, **kw: calls.append(kw["gated"]) or launch(*a, **kw))
    x, w, ids, *stacks = args = mmq_problem(rng, 3, ("Q8_0", "Q8_0", "Q6_K"))
    got = moe.moe_experts(*args, gemv=False, mmq=True, dequant=False)
    assert calls == [False]
    close(got, moe.moe_experts_ref(*args), 5e-2)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("gated,qtypes,n_cols,k_dim,loop_stages", [(True, ("Q4_K", "Q4_K"), 768, 2048, 0),
                                                                  (False, ("Q6_K", "Q6_K"), 2048, 768, 0),
                                                                  (True, ("Q6_K", "Q6_K"), 768, 2048, 0),
                                                                  (False, ("Q4_K", "Q4_K"), 2048, 768, 0),
                                                                  (True, ("Q4_K", "Q4_K"), 768, 2048, 3)])
def test_aot_sm90(gated, qtypes, n_cols, k_dim, loop_stages, tmp_path, monkeypatch, capsys):
    """Qwen3-30B-A3B's passes (Q4_K_M's, then the formats swapped) at the launcher's tiles, built for an H200 with
    the JIT's 16-byte specialization where the sizes have it: int8 MMAs, the grid-dependency wait, nothing spilled;
    prints registers and the main loop's instructions a super-block."""
    import triton
    from test_kernels_gemv import _stack_bytes
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function
    from kernels_src.registry import REGISTRY
    from tools.sass_mix import loop_mix

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    block_n, warps = moe_mmq.pass_tiles(gated, moe_mmq.BLOCK_M, qtypes)
    entry = REGISTRY["moe_mmq"]
    kir = entry.kernel("triton", num_warps=warps, GATED=gated, QTYPE_A=qtypes[0], QTYPE_B=qtypes[1],
                       BLOCK_N=block_n, LOOP_STAGES=loop_stages).trace(signature=entry.signature)
    row_bytes = {"Q4_K": 144, "Q6_K": 210}[qtypes[0]] * k_dim // 256
    sizes = dict(xq_stride=k_dim, xd_stride=k_dim // 256, xs_stride=k_dim // 32, a_stride=row_bytes,
                 b_stride=row_bytes, y_stride=n_cols, n_cols=n_cols)
    div16 = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kir.params)
             if p.name in entry.pointers or sizes.get(p.name, 1) % 16 == 0}
    fn = JITFunction(load_function(TritonRenderer().render(kir), kir.name))
    c = triton.compile(ASTSource(fn, signature=kir.signature, attrs=div16), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 3})
    ptx = c.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ".s8.s8" in ptx
    mix = loop_mix(c.asm["cubin"])
    with capsys.disabled():
        print(f"\nmoe_mmq {'gated' if gated else 'down'} {'/'.join(qtypes)} BLOCK_N {block_n} x {warps} warps: "
              f"{mix.registers} registers, {mix.instructions} instructions a super-block, stack {mix.stack}")
    assert mix.stack == 0 and _stack_bytes(c.asm["cubin"], tmp_path) == 0
    if loop_stages:  # the K loop pipelined: the weights by cp.async ahead, no global load waited for in the loop
        assert mix.opcodes["LDG"] == 0 < mix.opcodes["LDGSTS"], mix.summary()
