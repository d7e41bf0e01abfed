"""The kernel DSL itself: tracing rules, the IR printer, the numpy interpreter's semantics, the compile cache, and
the Triton emitter checked op by op against the interpreter under Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from kernels_src.dsl import TraceError, cache_info, format_kernel, tl, trace
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl.interpreter import run

HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")


def copy_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n, other=0.0) * 2.0, mask=offs < n)


def test_trace_and_print():
    k = trace(copy_kernel, {"x": "*fp16", "y": "*fp16", "n": "i32"}, {"BLOCK": 8})
    assert k.signature == {"x": "*fp16", "y": "*fp16", "n": "i32"} and k.grid_rank == 1
    text = format_kernel(k)
    assert text.splitlines()[0] == "kernel copy_kernel(%x: *fp16, %y: *fp16, %n: i32) [BLOCK=8] {"
    assert "arange {start=0, end=8} : i32[8]" in text
    assert "load %" in text and "mul %" in text and text.rstrip().endswith("}")
    consts = [op for op in k.walk() if op.opcode == "const"]
    assert {str(op.result.dtype) for op in consts} == {"i32", "fp16"}  # 2.0 takes the tile's dtype


def test_ir_shape_rules():
    def kern(x, y, n):
        a = tl.arange(0, 16)
        m = tl.load(x + a[:, None] * 4 + tl.arange(0, 4)[None, :])  # [16, 1] + [1, 4] -> explicit broadcasts
        tl.store(y + a, tl.sum(m, axis=1) + n)

    k = trace(kern, {"x": "*fp32", "y": "*fp32", "n": "i32"})
    ops = list(k.walk())
    for op in ops:
        if op.opcode in ("add", "mul", "ptr_add", "lt", "where"):
            assert all(a.shape in ((), op.result.shape) for a in op.args), (op.opcode, [a.type for a in op.args])
    assert sum(op.opcode == "broadcast" for op in ops) == 2
    assert [op.attrs for op in ops if op.opcode == "reduce"] == [{"kind": "sum", "axis": 1}]


@pytest.mark.parametrize("body,match", [
    (lambda x: tl.exp(tl.load(x).to(tl.float16)), "needs fp32"),
    (lambda x: tl.arange(0, 12), "powers of two"),
    (lambda x: tl.dot(tl.zeros([8, 16], tl.float16), tl.zeros([16, 16], tl.float16)), ">= 16"),
    (lambda x: 1 if tl.load(x) > 0 else 0, "truth value"),
    (lambda x: tl.fori_loop(0, 4, lambda i, a: a.to(tl.float16), tl.load(x)), "changes from fp32"),
    (lambda x: tl.store(x, tl.load(x) // 2), "for integers"),
    (lambda x: x * 2, "pointer arithmetic"),
    (lambda x: tl.reshape(tl.zeros([4, 8], tl.float32), (4, 4)), "element counts differ"),
])
def test_trace_errors(body, match):
    def kern(x):
        body(x)

    with pytest.raises(TraceError, match=match):
        trace(kern, {"x": "*fp32"})


def test_loop_values_do_not_escape():
    def kern(x):
        inner = []
        tl.fori_loop(0, 4, lambda i, a: inner.append(a + 1.0) or inner[-1], tl.load(x))
        tl.store(x, inner[0])

    with pytest.raises(TraceError, match="inside a loop body"):
        trace(kern, {"x": "*fp32"})


def test_missing_constexpr():
    with pytest.raises(TraceError, match="constexpr BLOCK"):
        trace(copy_kernel, {"x": "*fp32", "y": "*fp32", "n": "i32"})


def test_interpreter_masks_views_and_bounds():
    x = np.arange(40, dtype=np.float32)
    y = np.full(40, -1.0, np.float32)
    k = trace(copy_kernel, {"x": "*fp32", "y": "*fp32", "n": "i32"}, {"BLOCK": 8})
    run(k, 2, x[10:], y[5:], 13)  # pointers start at the views' first elements
    np.testing.assert_array_equal(y[5:18], 2 * x[10:23])
    assert (y[:5] == -1).all() and (y[18:] == -1).all()
    with pytest.raises(IndexError, match="out of bounds"):  # bounds are the allocation's, not a view's
        run(k, 1, x[:4].copy(), y, 8)

    def no_other(x, y):
        offs = tl.arange(0, 4)
        tl.store(y + offs, tl.load(x + offs, mask=offs < 2))

    run(trace(no_other, {"x": "*fp32", "y": "*fp32"}), 1, x, y)
    assert np.isnan(y[2:4]).all()  # masked-out lanes of a load without `other` are poison


# --- one kernel per feature group, run on the interpreter and (emitted) on Triton's interpreter ------------------

def int_kernel(a, b, packed, half_bits, out_i, out_f):
    i = tl.arange(0, 16)
    av = tl.load(a + i)
    bv = tl.load(b + i)
    byte = tl.load(packed + i)  # u8
    lo, hi = (byte & 0xF).to(tl.int32), (byte >> 4).to(tl.int32)
    tl.store(out_i + i, av // bv)  # C division and remainder: toward zero
    tl.store(out_i + 16 + i, av % bv)
    tl.store(out_i + 32 + i, (lo - 8) * 16 + hi)
    tl.store(out_i + 48 + i, (av << 2) ^ (~bv) | (av >> 1))
    tl.store(out_i + 64 + i, tl.where((av > 0) & (bv != 3), tl.maximum(av, bv), tl.minimum(av, -bv)))
    h = tl.load(half_bits.to(tl.pointer_type(tl.uint16)) + i)  # fp16 bits out of a byte buffer
    tl.store(out_f + i, h.to(tl.float16, bitcast=True).to(tl.float32))
    tl.store(out_f + 16 + i, tl.abs(av).to(tl.float32) / 3)


def float_kernel(x, w, n, out, red):
    r = tl.arange(0, 16)
    c = tl.arange(0, 32)
    xt = tl.load(x + r[:, None] * 32 + c[None, :])  # fp16 [16, 32]
    wt = tl.load(w + c[:, None] * 16 + r[None, :])  # fp16 [32, 16]

    def body(it, acc, m):
        scale = (it + 1).to(tl.float32)
        return acc + tl.dot(xt, wt) * scale, tl.maximum(m, scale)

    acc, m = tl.fori_loop(0, n, body, (tl.zeros([16, 16], tl.float32), 1.0))
    tl.store(out + r[:, None] * 16 + r[None, :], tl.trans(acc) / m)
    f = xt.to(tl.float32)
    tl.store(red + r, tl.max(f, axis=1) + tl.min(f, axis=1))
    tl.store(red + 16 + c, tl.sum(f, axis=0))
    y = tl.sum(f, axis=1, keep_dims=True) * 0.1
    v = tl.exp(y) + tl.log(tl.abs(y) + 1.0) + tl.sqrt(tl.abs(y)) + tl.rsqrt(tl.abs(y) + 1.0) + tl.sin(y)
    v = v + tl.cos(y) + tl.erf(y) + tl.tanh(y) + tl.exp2(y) + tl.log2(tl.abs(y) + 1.0) + tl.floor(y) + tl.ceil(y)
    tl.store(red + 48 + r[:, None] + tl.zeros([16, 1], tl.int32), v)


def _int_inputs(rng):
    a = rng.integers(-50, 50, 16).astype(np.int32)
    b = rng.integers(1, 9, 16).astype(np.int32) * rng.choice([-1, 1], 16).astype(np.int32)
    packed = rng.integers(0, 256, 16).astype(np.uint8)
    halves = rng.standard_normal(16).astype(np.float16)
    return a, b, packed, halves


def _run_int(target, a, b, packed, halves):
    out_i, out_f = np.zeros(80, np.int32), np.full(32, np.nan, np.float32)
    args = [a, b, packed, np.frombuffer(halves.tobytes(), np.uint8).copy(), out_i, out_f]
    if target != "numpy":
        import torch

        args = [torch.from_numpy(x) for x in args]
    dsl_compile(int_kernel, target)[1](*args)
    return [np.asarray(args[i]) for i in (4, 5)]


def test_int_semantics():
    a, b, packed, halves = _int_inputs(np.random.default_rng(1))
    out_i, out_f = _run_int("numpy", a, b, packed, halves)
    np.testing.assert_array_equal(out_i[:16], np.trunc(a / b).astype(np.int32))
    np.testing.assert_array_equal(out_i[16:32], np.fmod(a, b))
    lo, hi = (packed & 0xF).astype(np.int32), (packed >> 4).astype(np.int32)
    np.testing.assert_array_equal(out_i[32:48], (lo - 8) * 16 + hi)
    np.testing.assert_array_equal(out_i[48:64], (a << 2) ^ (~b) | (a >> 1))
    np.testing.assert_array_equal(out_i[64:], np.where((a > 0) & (b != 3), np.maximum(a, b), np.minimum(a, -b)))
    np.testing.assert_array_equal(out_f[:16], halves.astype(np.float32))


def _run_float(target, x, w, n):
    out, red = np.full((16, 16), np.nan, np.float32), np.full(64, np.nan, np.float32)
    args = [x, w, n, out, red]
    if target != "numpy":
        import torch

        args = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    dsl_compile(float_kernel, target)[1](*args)
    return np.asarray(args[3]), np.asarray(args[4])


def test_float_semantics():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((16, 32)).astype(np.float16), rng.standard_normal((32, 16)).astype(np.float16)
    out, red = _run_float("numpy", x, w, 3)
    xf = x.astype(np.float32)
    np.testing.assert_allclose(out, (xf @ w.astype(np.float32)).T * 6 / 3, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(red[:16], xf.max(1) + xf.min(1))
    np.testing.assert_allclose(red[16:48], xf.sum(0), rtol=1e-6, atol=1e-5)
    assert np.isfinite(red).all()


@needs_triton
def test_triton_matches_interpreter_int():
    inputs = _int_inputs(np.random.default_rng(3))
    for want, got in zip(_run_int("numpy", *inputs), _run_int("triton-interpret", *inputs), strict=True):
        np.testing.assert_array_equal(got, want)


@needs_triton
@pytest.mark.parametrize("n", [0, 2])
def test_triton_matches_interpreter_float(n):
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((16, 32)).astype(np.float16), rng.standard_normal((32, 16)).astype(np.float16)
    for want, got in zip(_run_float("numpy", x, w, n), _run_float("triton-interpret", x, w, n), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
def test_triton_source_and_aot_of_loops():
    from kernels_src.dsl.triton_target import aot_compile

    k = dsl_compile(float_kernel, "triton")
    sig = {"x": "*fp16", "w": "*fp16", "n": "i32", "out": "*fp32", "red": "*fp32"}
    src = k.source(signature=sig)
    assert "def float_kernel(x, w, n, out, red):" in src and "for i" in src and "tl.dot(" in src
    assert ".target sm_90a" in aot_compile(k.trace(signature=sig)).asm["ptx"]


def test_compile_cache():
    a = dsl_compile(copy_kernel, "numpy", BLOCK=8)
    assert dsl_compile(copy_kernel, "numpy", BLOCK=8) is a
    assert dsl_compile(copy_kernel, "numpy", BLOCK=16) is not a
    x, y = np.ones(8, np.float32), np.zeros(8, np.float32)
    before = cache_info()["compiled"]
    a[1](x, y, 8)
    a[1](x, y, 5)
    assert cache_info()["compiled"] == before + 1  # one signature, one build
    a[1](x.astype(np.float16), y.astype(np.float16), 8)
    assert cache_info()["compiled"] == before + 2
    assert len(a.source(x, y, 8).splitlines()) > 3


# --- the shape of the attention kernels to come: a runtime loop over a block table with online softmax ----------

def decode_sketch_kernel(q, k_cache, v_cache, block_tables, context_lens, out, scale, max_blocks,
                         GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, N_KV: tl.constexpr):
    s, kvh = tl.program_id(0), tl.program_id(1)
    g, d, j = tl.arange(0, GROUP), tl.arange(0, D), tl.arange(0, BS)
    rows = (s * N_KV + kvh) * GROUP + g
    qv = tl.load(q + rows[:, None] * D + d[None, :]).to(tl.float32)
    ctx = tl.load(context_lens + s)

    def body(b, m, denom, acc):
        blk = tl.load(block_tables + s * max_blocks + b).to(tl.int64)
        valid = (b * BS + j) < ctx
        at = (blk * BS + j)[:, None] * (N_KV * D) + kvh * D + d[None, :]
        kt = tl.load(k_cache + at, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid[None, :], tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p, alpha = tl.exp(scores - m_new[:, None]), tl.exp(m - m_new)
        vt = tl.load(v_cache + at, mask=valid[:, None], other=0.0).to(tl.float32)
        return m_new, denom * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None], axis=1)

    init = (tl.full([GROUP], float("-inf"), tl.float32), tl.zeros([GROUP], tl.float32),
            tl.zeros([GROUP, D], tl.float32))
    m, denom, acc = tl.fori_loop(0, (ctx + BS - 1) // BS, body, init)
    tl.store(out + rows[:, None] * D + d[None, :], acc / denom[:, None])


@pytest.mark.parametrize("target", ["numpy", pytest.param("triton-interpret", marks=needs_triton)])
def test_online_softmax_over_block_table(target):
    rng = np.random.default_rng(5)
    seqs, n_kv, group, d, bs, n_blocks, max_blocks = 2, 2, 2, 8, 4, 8, 3
    q = rng.standard_normal((seqs, n_kv * group, d)).astype(np.float32)
    kc, vc = (rng.standard_normal((n_blocks, bs, n_kv, d)).astype(np.float16) for _ in range(2))
    kc[0], vc[0] = np.nan, np.nan  # a block no sequence owns: reading it would poison the result
    tables = np.array([[3, 5, 0], [7, 1, 2]], np.int32)
    ctx = np.array([6, 11], np.int32)
    out = np.full(q.shape, np.nan, np.float32)
    args = [q, kc, vc, tables, ctx, out, 0.3, max_blocks]
    if target != "numpy":
        import torch

        args = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
    dsl_compile(decode_sketch_kernel, target, GROUP=group, D=d, BS=bs, N_KV=n_kv)[seqs, n_kv](*args)
    for s in range(seqs):
        blocks = tables[s, :-(-ctx[s] // bs)]
        k = kc[blocks].reshape(-1, n_kv, d)[:ctx[s]].astype(np.float32)
        v = vc[blocks].reshape(-1, n_kv, d)[:ctx[s]].astype(np.float32)
        for h in range(n_kv * group):
            w = np.exp(0.3 * k[:, h // group] @ q[s, h] - (0.3 * k[:, h // group] @ q[s, h]).max())
            np.testing.assert_allclose(np.asarray(args[5])[s, h], w @ v[:, h // group] / w.sum(), rtol=1e-5,
                                       atol=1e-5)


def reshape_kernel(x, out):
    """A [4, 8, 2] tile reshaped as values ([8, 8] through a broadcast and a reduction, [64]) and as pointers."""
    a, b, c = tl.arange(0, 4)[:, None, None], tl.arange(0, 8)[None, :, None], tl.arange(0, 2)[None, None, :]
    ptr = x + a * 16 + b * 2 + c
    v = tl.load(ptr) * 3.0
    flat = tl.reshape(v, (64,))
    tl.store(out + tl.arange(0, 64), flat)
    sq = tl.reshape(v + tl.zeros([4, 1, 2], tl.float32), (8, 8))  # rows 2a + b // 4, columns 2 (b % 4) + c
    tl.store(out + 64 + tl.arange(0, 8)[:, None] * 8 + tl.arange(0, 8)[None, :], sq)
    tl.store(out + 128 + tl.arange(0, 8), tl.sum(sq, axis=1))
    tl.store(tl.reshape(ptr, (16, 4)) + 200, tl.reshape(tl.load(ptr), (16, 4)) + 1.0)


@pytest.mark.parametrize("target", ["numpy", "simt-cpu", pytest.param("triton-interpret", marks=needs_triton)])
def test_reshape(target):
    x = np.full(264, np.nan, np.float32)
    x[:64] = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    out = np.full(136, np.nan, np.float32)
    args = [x, out]
    if target == "triton-interpret":
        import torch

        args = [torch.from_numpy(a) for a in args]
    dsl_compile(reshape_kernel, target)[1](*args)
    want = x[:64] * 3.0
    np.testing.assert_allclose(out[:64], want, rtol=1e-6)
    np.testing.assert_allclose(out[64:128], want, rtol=1e-6)
    np.testing.assert_allclose(out[128:], want.reshape(8, 8).sum(1), rtol=1e-5)
    np.testing.assert_allclose(x[200:264], x[:64] + 1.0, rtol=1e-6)


@needs_triton
def test_direct_key_is_as_fine_as_tritons_specialization():
    """A compiled kernel is reused through its C launcher only for arguments that Triton would have compiled the
    same binary for: the key must tell apart what Triton specializes on (an address off 16 bytes, an integer equal
    to 1, divisible by 16, or past 32 bits) and dtypes."""
    import torch

    from kernels_src.dsl.triton_target import direct_key

    x = torch.zeros(64, dtype=torch.float16)
    base = direct_key((x, 16, 2.0))
    assert direct_key((torch.zeros(64, dtype=torch.float16), 32, 3.0)) == base  # same specialization
    assert direct_key((x[1:], 16, 2.0)) != base  # 2 bytes off alignment
    assert direct_key((x.float(), 16, 2.0)) != base
    assert len({direct_key((x, n, 2.0)) for n in (1, 2, 16, 17, 2**31, -16)}) == 4  # 1 | odd | x16 | 64-bit
    assert direct_key((x, 1, 2.0)) != direct_key((x, True, 2.0))
    assert direct_key((x, 16, np.float32(2.0))) != direct_key((x, 16, np.float32(3.0)))  # unknown: by value
