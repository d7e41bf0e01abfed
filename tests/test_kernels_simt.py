"""The SIMT lowering and its C-like emitters, with no GPU: every kernel of kernels_src runs through the CPU oracle
(the SIMT form rendered as C++ by the same renderer as Metal and CUDA C, compiled here, every thread a fiber,
threadgroup memory race-checked) against the numpy references, on poisoned outputs and shapes off the tiles; planted
mistakes are caught (the sources' libclang parse checks: test_kernels_sources.py). On a CUDA machine
with CuPy the same numerical cases run the CUDA C twin (target "cuda")."""

from __future__ import annotations

import importlib.util
import zlib

import numpy as np
import pytest
from test_kernels_attention import DECODE_CASES, PREFILL_CASES, paged_cache
from test_kernels_dsl import _int_inputs, decode_sketch_kernel, float_kernel, int_kernel
from test_kernels_gemv import k_for, padded_weights

from kernels_src import (
    activations,
    dense_gemm,
    dense_gemv,
    dequant_gemm,
    fp8_gemm,
    fp8_gemv,
    gguf_mmq,
    gguf_mmq_sb,
    int_group_gemm,
    int_group_gemv,
    int_group_mmq,
    kv_write,
    mla_decode,
    moe,
    moe_align,
    moe_gemv,
    moe_gguf,
    moe_mmq,
    moe_route,
    rms_norm,
    rope,
    rope_kv_write,
)
from kernels_src import dequant_gemv as dg
from kernels_src import dequantize as dq
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import simt
from kernels_src.dsl.cpu_target import CpuKernel, SimtError
from kernels_src.registry import REGISTRY


def _has_cuda() -> bool:
    if importlib.util.find_spec("cupy") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


TARGETS = ["simt-cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _has_cuda(), reason="no CUDA + CuPy"))]
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float16: dict(rtol=3e-3, atol=3e-3)}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def dev(a, target):
    if target == "cuda" and isinstance(a, np.ndarray):
        import torch

        return torch.from_numpy(a).cuda()
    return a


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


def poisoned(shape, dtype, target):
    return dev(np.full(shape, np.nan, dtype), target)


def close(got, want, dtype):
    got = host(got).astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(want, np.float32), **TOL[dtype])


# --- every kernel through the lowered SIMT form --------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows,n,offset", [(3, 100, True), (4, 257, False), (2, 1000, False)])
def test_rms_norm(target, dtype, rows, n, offset, rng):
    x = rng.standard_normal((rows, n + 7)).astype(dtype)[:, :n]
    w = rng.standard_normal(n).astype(dtype)
    out = poisoned((rows, n), dtype, target)
    rms_norm.rms_norm(dev(x, target), dev(w, target), 1e-6, offset=offset, out=out, target=target)
    close(out, rms_norm.rms_norm_ref(x, w, 1e-6, offset), dtype)


def test_rms_norm_bf16(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal((3, 100)).astype(np.float32)).bfloat16()
    w = torch.from_numpy(rng.standard_normal(100).astype(np.float32)).bfloat16()
    out = torch.full((3, 100), float("nan"), dtype=torch.bfloat16)
    rms_norm.rms_norm(x, w, 1e-6, out=out, target="simt-cpu")
    ref = torch.from_numpy(rms_norm.rms_norm_ref(x.float().numpy(), w.float().numpy(), 1e-6)).bfloat16()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_add_rms_norm(target, dtype, rng):
    x, r = (rng.standard_normal((3, 130)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(130).astype(dtype)
    s_out, out = (poisoned((3, 130), dtype, target) for _ in range(2))
    rms_norm.add_rms_norm(dev(x, target), dev(r, target), dev(w, target), 1e-5, sum_out=s_out, out=out,
                          target=target)
    s_ref, out_ref = rms_norm.add_rms_norm_ref(x, r, w, 1e-5)
    close(s_out, s_ref, dtype)
    close(out, out_ref, dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope(target, dtype, interleaved, rng):
    tokens, hq, hk, d, rot = 5, 3, 1, 24, 16
    qkv = rng.standard_normal((tokens, hq + 2 * hk, d)).astype(dtype)
    angles = np.arange(64)[:, None] * rng.uniform(0.01, 1.0, rot // 2)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = rng.integers(0, 64, tokens).astype(np.int64)
    want = [rope.rope_ref(t, positions, cos, sin, interleaved) for t in (qkv[:, :hq], qkv[:, hq:hq + hk])]
    buf = dev(qkv, target)  # q and k are views into one fused projection, rotated in place
    rope.rope(buf[:, :hq], buf[:, hq:hq + hk], dev(positions, target), dev(cos, target), dev(sin, target),
              interleaved=interleaved, target=target)
    got = host(buf)
    close(got[:, :hq], want[0], dtype)
    close(got[:, hq:hq + hk], want[1], dtype)
    np.testing.assert_array_equal(got[:, hq + hk:], qkv[:, hq + hk:])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("act,dtype", [("silu", np.float16), ("gelu", np.float32), ("gelu_tanh", np.float32)])
@pytest.mark.parametrize("tokens,inner", [(3, 40), (2, 64)])
def test_gated_act(target, act, dtype, tokens, inner, rng):
    gate_up = (2 * rng.standard_normal((tokens, 2 * inner))).astype(dtype)
    out = poisoned((tokens, inner), dtype, target)
    activations.gated_act_fused(dev(gate_up, target), act, out=out, block=16, target=target)
    close(out, activations.gated_act_ref(gate_up[:, :inner], gate_up[:, inner:], act), dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype,slot_dtype,heads,d,block_size", [(np.float32, np.int64, 2, 8, 4),
                                                                 (np.float16, np.int32, 3, 12, 2)])
def test_kv_write(target, dtype, slot_dtype, heads, d, block_size, rng):
    k, v = (rng.standard_normal((5, heads, d)).astype(dtype) for _ in range(2))
    slots = rng.permutation(5 * block_size)[:5].astype(slot_dtype)
    slots[1] = -1
    caches = [np.full((5, block_size, heads, d), np.nan, dtype) for _ in range(2)]
    want = [c.copy() for c in caches]
    kv_write.kv_write_ref(k, v, *want, slots)
    got = [dev(c, target) for c in caches]
    kv_write.kv_write(dev(k, target), dev(v, target), *got, dev(slots, target), target=target)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(host(g), w)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case,dtype", [(c, np.float32) for c in DECODE_CASES] + [("gqa4_split", np.float16)])
def test_paged_decode(target, case, dtype, rng):
    hq, hkv, d, bs, ctx, partition, block_n, window, cap = DECODE_CASES[case]
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, dtype)
    ctx = np.array(ctx, np.int32)
    q = rng.standard_normal((len(ctx), hq, d)).astype(dtype)
    out = poisoned(q.shape, dtype, target)
    pa.paged_decode(*(dev(a, target) for a in (q, kc, vc, tables, ctx)), 0.3, sliding_window=window, softcap=cap,
                    out=out, partition=partition, block_n=block_n, target=target)
    close(out, pa.paged_decode_ref(q, kc, vc, tables, ctx, 0.3, sliding_window=window, softcap=cap), dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case,dtype", [(c, np.float32) for c in PREFILL_CASES] + [("chunked_gqa4", np.float16)])
def test_paged_prefill(target, case, dtype, rng):
    hq, hkv, d, bs, q_lens, ctx, block_m, window, cap = PREFILL_CASES[case]
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, dtype)
    ctx = np.array(ctx, np.int32)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((qs[-1], hq, d)).astype(dtype)
    out = poisoned(q.shape, dtype, target)
    pp.paged_prefill(*(dev(a, target) for a in (q, kc, vc, tables, ctx, qs)), 0.3, sliding_window=window,
                     softcap=cap, out=out, block_m=block_m, block_n=16, target=target)
    close(out, pp.paged_prefill_ref(q, kc, vc, tables, ctx, qs, 0.3, sliding_window=window, softcap=cap), dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype,dtype", [(q, np.float32) for q in dg.QTYPES] + [("Q4_K", np.float16)])
def test_dequant_gemv(target, qtype, dtype, rng):
    k = k_for(qtype, 3 if qtype.endswith("K") else 15)
    w = padded_weights(rng, qtype, 9, k)
    x = rng.standard_normal((3, k)).astype(dtype)
    out = poisoned((3, 9), dtype, target)
    dg.dequant_gemv(dev(x, target), dev(w, target), qtype, out=out, target=target)
    want = dg.dequant_gemv_ref(x, w, qtype)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(host(out).astype(np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", dq.QTYPES)
def test_dequantize_rows(target, qtype, rng):
    """Repeated row ids into padded rows, one partial tile a row; exact in fp32 (no subnormals are involved)."""
    k = k_for(qtype, 3 if qtype.endswith("K") else 20)
    w = padded_weights(rng, qtype, 6, k, pad=6)
    rows = np.array([5, 0, 5, 2], np.int32)
    out = poisoned((4, k), np.float32, target)
    dq.dequantize_rows(dev(w, target), dev(rows, target), qtype, k, out=out, blocks=2, num_warps=1, target=target)
    np.testing.assert_array_equal(host(out), dq.dequantize_rows_ref(w, rows, qtype, k))


COVERED = {rms_norm.rms_norm_kernel, rms_norm.add_rms_norm_kernel, rope.rope_kernel, activations.gated_act_kernel,
           kv_write.kv_write_kernel, pa.paged_decode_kernel, pa.paged_decode_reduce_kernel, pp.paged_prefill_kernel,
           dg.dequant_gemv_kernel, dq.dequantize_rows_kernel,
           rope_kv_write.rope_kv_write_kernel,  # its simt-cpu case: test_kernels_rope_kv_write.py
           dequant_gemm.dequant_gemm_kernel,  # its simt-cpu case: test_kernels_gemm.py
           gguf_mmq.mmq_q4k_kernel, gguf_mmq.mmq_q6k_kernel,  # their simt-cpu case: test_kernels_mmq.py
           gguf_mmq_sb.mmq_sb_q4k_kernel, gguf_mmq_sb.mmq_sb_q6k_kernel,  # likewise
           moe.moe_gemm_kernel,  # its simt-cpu case: test_kernels_moe.py
           moe_gguf.moe_qgemm_kernel,  # its simt-cpu case: test_kernels_moe_gguf.py
           moe_mmq.moe_mmq_kernel,  # its simt-cpu case: test_kernels_moe_mmq.py
           moe_gemv.moe_gemv_kernel, moe_gemv.moe_qgemv_kernel,  # their simt-cpu case: test_kernels_moe_gemv.py
           moe_route.moe_route_kernel,  # its simt-cpu case: test_kernels_moe_route.py
           moe_align.moe_align_kernel,  # its simt-cpu case: test_kernels_moe_align.py
           mla_decode.mla_decode_kernel,  # its simt-cpu case: test_kernels_mla.py
           dense_gemv.dense_gemv_kernel,  # its simt-cpu case: test_kernels_dense_gemv.py
           dense_gemm.dense_gemm_kernel,  # its simt-cpu case: test_kernels_dense_gemm.py
           # their simt-cpu case: test_kernels_int_group.py
           int_group_gemv.int_group_gemv_kernel, int_group_gemv.int_group_dequantize_kernel,
           int_group_gemm.int_group_gemm_kernel,  # its simt-cpu case: test_kernels_int_group_gemm.py
           int_group_mmq.int_group_mmq_kernel,  # its simt-cpu case: test_kernels_int_group_mmq.py
           fp8_gemv.fp8_gemv_kernel,  # its simt-cpu case: test_kernels_fp8_gemv.py
           fp8_gemm.fp8_gemm_kernel}  # FP8 dots: test_kernels_fp8_gemm.py checks that the SIMT targets refuse it


def test_every_registered_kernel_has_a_simt_case():
    missing = sorted({e.name for e in REGISTRY.values() if e.fn not in COVERED})
    assert not missing, f"add SIMT oracle cases to tests/test_kernels_simt.py for {missing}"


# --- op semantics: the DSL's own feature kernels against the numpy interpreter -----------------------------------

def test_int_and_bit_ops(rng):
    a, b, packed, halves = _int_inputs(rng)
    outs = {}
    for target in ("numpy", "simt-cpu"):
        out_i, out_f = np.zeros(80, np.int32), np.full(32, np.nan, np.float32)
        dsl_compile(int_kernel, target)[1](a, b, packed, np.frombuffer(halves.tobytes(), np.uint8).copy(), out_i,
                                           out_f)
        outs[target] = (out_i, out_f)
    np.testing.assert_array_equal(outs["simt-cpu"][0], outs["numpy"][0])
    np.testing.assert_array_equal(outs["simt-cpu"][1], outs["numpy"][1])


@pytest.mark.parametrize("n", [0, 3])
def test_loops_dot_trans_and_math(n, rng):
    x, w = rng.standard_normal((16, 32)).astype(np.float16), rng.standard_normal((32, 16)).astype(np.float16)
    outs = {}
    for target in ("numpy", "simt-cpu"):
        out, red = np.full((16, 16), np.nan, np.float32), np.full(64, np.nan, np.float32)
        dsl_compile(float_kernel, target)[1](x, w, n, out, red)
        outs[target] = (out, red)
    for got, want in zip(outs["simt-cpu"], outs["numpy"], strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_online_softmax_sketch(rng):
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    kc, vc = (rng.standard_normal((8, 4, 2, 8)).astype(np.float16) for _ in range(2))
    tables, ctx = np.array([[3, 5, 0], [7, 1, 2]], np.int32), np.array([6, 11], np.int32)
    outs = []
    for target in ("numpy", "simt-cpu"):
        out = np.full(q.shape, np.nan, np.float32)
        dsl_compile(decode_sketch_kernel, target, GROUP=2, D=8, BS=4, N_KV=2)[2, 2](q, kc, vc, tables, ctx, out,
                                                                                     0.3, 3)
        outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_layouts():
    from kernels_src.dsl import layout as lay

    c = lay.canonical((4, 64), 128)  # 256 elements on 128 threads: two slots, the row's high bit in the slot
    assert c.tbits == (0, 1, 2, 3, 4, 5, 6) and c.rbits == (7,)
    small = lay.canonical((16,), 128)
    assert small.tbits[:4] == (0, 1, 2, 3) and small.replicated_mask == 0b1110000
    b, src = lay.broadcast(lay.Layout((16, 1), small.tbits, ()), (16, 32))  # new bits fill replicated threads
    assert b.tbits == (5, 6, 7, 8, 0, 1, 2) and b.rbits == (3, 4) and src == [None, None]
    plan = lay.reduce(c, 1)  # along the row: 5 lane bits (simd_sum), 1 warp bit (smem), no slot bits
    assert plan.lane_axis == [0, 1, 2, 3, 4] and plan.warp_axis == [5] and plan.slot_axis == []
    assert plan.out.shape == (4,) and plan.out.tbits[6] == 0 and plan.out.rbits == (1,)
    assert lay.transpose(lay.canonical((2, 8), 32)).tbits == (1, 2, 3, 0, None)


# --- the oracle catches what a GPU would silently get wrong ----------------------------------------------------

def _rms_args(rng):
    x = rng.standard_normal((2, 300)).astype(np.float32)
    return x, np.ones(300, np.float32), np.full((2, 300), np.nan, np.float32), 300, 300, 300, 1e-6


def test_oracle_catches_a_missing_barrier(rng, monkeypatch):
    k = REGISTRY["rms_norm"].trace(signature={"x": "*fp32", "w": "*fp32", "out": "*fp32"}, BLOCK=512)
    monkeypatch.setattr(simt.Lowering, "barrier", lambda self: setattr(self, "dirty", False))  # emit none
    with pytest.raises(SimtError, match="race"):
        CpuKernel(simt.lower(k))(2, *_rms_args(rng))


def test_oracle_catches_divergent_barriers_and_out_of_bounds(rng):
    k = REGISTRY["rms_norm"].trace(signature={"x": "*fp32", "w": "*fp32", "out": "*fp32"}, BLOCK=512)
    kern = CpuKernel(simt.lower(k))
    x, w, out, *rest = _rms_args(rng)
    kern(2, x, w, out, *rest)
    np.testing.assert_allclose(out, rms_norm.rms_norm_ref(x, w, 1e-6), rtol=2e-5, atol=2e-5)
    with pytest.raises(SimtError, match="global load out of bounds"):
        kern(3, x, w, out, *rest)  # a third row past the end of x
    from kernels_src.dsl.cpu_target import build

    src = kern.source.replace("dsl::barrier(__LINE__);",  # half the threads wait at another barrier
                              "if (dsl_tid < 64) dsl::barrier(__LINE__); else dsl::barrier(-1);")
    kern.lib = build(src)
    with pytest.raises(SimtError, match="different barriers"):
        kern(2, x, w, out, *rest)
