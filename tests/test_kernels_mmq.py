"""The int8 tensor-core GEMM (kernels_src/gguf_mmq.py, each variant: per32, and gguf_mmq_sb.py's per32p and per256)
on random valid Q4_K and Q6_K blocks, outputs poisoned first: the DSL interpreter, Triton's interpreter and the SIMT
lowering against x's int8 quantization times our numpy dequantizer (float64), tight; against x itself within what
that quantization allows; 4..33 rows, ragged N, split-K; the x pre-passes' scales and block sums; planted bugs; the
DSL's int8 dot; the sm_90 SASS's instruction mix; and Triton AOT builds for sm_90 (int8 wgmma, no spills, the
grid-dependency wait)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, padded_weights

from kernels_src import dequant_gemm as dgm
from kernels_src import gguf_mmq as mq
from kernels_src import gguf_mmq_sb as sb
from kernels_src import split_k
from kernels_src.dequant_gemv_i8 import int8_error_bound, quantize_x, quantize_x_ref
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import launch as dsl_launch
from kernels_src.dsl import tl

needs_aot = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="AOT builds need triton, and TRITON_INTERPRET unset")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


GROUP = {"per32": 32, "per32p": 32, "per256": 256}


def _run(target, x, w, qtype, **kw):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, x.dtype), target)
    y = mq.mmq(dev(x, target), dev(np.ascontiguousarray(w) if target != "numpy" else w, target), qtype, out=out,
               target=target, **kw)
    assert y is out
    got = host(out).astype(np.float64)
    assert np.isfinite(got).all(), "outputs left unwritten (NaN) or NaN computed"
    return got


def _check(got, x, w, qtype, tol, variant="per32"):
    want = mq.mmq_ref(x, w, qtype, variant)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    exact = dgm.dequant_matmul_ref(x, w, qtype)  # x unquantized: within the quantization's bound
    bound = int8_error_bound(x, w, qtype, GROUP[variant])
    assert (np.abs(got - exact) <= bound + tol * np.abs(exact).max()).all()


# per32p differs from per32 in Q4_K's decoding alone (its Q6_K kernel is per32's): fewer cases
CASES = [(q, v) for q in mq.MMQ_QTYPES for v in mq.VARIANTS if q == "Q4_K" or v != "per32p"]


@pytest.mark.parametrize("m,qtype,dtype,split,variant", [
    (m, q, dt, sp, v) for m in (4, 17, 33) for q, v in CASES for dt in (np.float32, np.float16) for sp in (None, 3)
    if v != "per32p" or (dt == np.float32 and sp == 3)])  # per32p: its arithmetic is per32's
def test_mmq_interpreter(m, qtype, dtype, split, variant, rng):
    """33 rows take a 64-row tile; 131 columns 3 tiles of 64, the last ragged; 3 super-blocks over 3 splits."""
    k = 768
    w = padded_weights(rng, qtype, 131, k)
    x = rng.standard_normal((m, k)).astype(dtype)
    _check(_run("numpy", x, w, qtype, split_k=split, variant=variant), x.astype(np.float32), w, qtype,
           1e-5 if dtype == np.float32 else 2e-3, variant)


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
@pytest.mark.parametrize("qtype,m,variant", [(q, m, v) for q, v in CASES for m in ((9, 20) if q == "Q4_K" else (20,))
                                              if m == 20 or v == "per256"])
def test_mmq_triton_interpreter(qtype, m, variant, rng):
    """9 rows: per256's minimums by FFMA; 20: by fp16 MMA."""
    k = 512
    w = padded_weights(rng, qtype, 37, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    _check(_run("triton-interpret", x, w, qtype, split_k=2, variant=variant), x, w, qtype, 1e-5, variant)


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
@pytest.mark.parametrize("qtype", mq.MMQ_QTYPES)
def test_mmq_loop_stages_change_no_number(qtype, rng):
    """The K loop pipelined (loop_stages, LLM_ENGINE_MMQ_LOOP_STAGES: Triton's tl.range stages) computes what the
    plain loop does, bit for bit, through Triton's own source (the interpreter); its loads are test_aot_sm90's."""
    k = 1024
    w = padded_weights(rng, qtype, 37, k)
    x = rng.standard_normal((20, k)).astype(np.float32)
    plain = _run("triton-interpret", x, w, qtype, split_k=2, variant="per256")
    np.testing.assert_array_equal(_run("triton-interpret", x, w, qtype, split_k=2, variant="per256", loop_stages=2),
                                  plain)
    _check(plain, x, w, qtype, 1e-5, "per256")


@pytest.mark.parametrize("qtype,variant", CASES)
def test_mmq_simt_cpu(qtype, variant, rng):
    """The SIMT lowering (the CPU oracle of the Metal and CUDA C emitters) runs the int8 dot too."""
    k = 512
    w = padded_weights(rng, qtype, 19, k)
    x = rng.standard_normal((18, k)).astype(np.float32)
    _check(_run("simt-cpu", x, w, qtype, block_n=16, split_k=2, variant=variant), x, w, qtype, 1e-5, variant)


def test_per256_extremes(rng):
    """Every nibble 15 (and 0), the largest 6-bit scales and mins, x at +-max|x| everywhere: the int32 sums at
    their bound (|S| < 3.8e8) stay exact, and the high nibbles' -128 offset is taken back."""
    k, n = 512, 20
    w = padded_weights(rng, "Q4_K", n, k)
    blocks = w[:, :288].reshape(n, 2, 144)
    blocks[:, :, 4:16] = 0xFF  # every scale and min 63
    blocks[:10, :, 16:] = 0xFF  # quants 15 (rows 10.. keep random ones)
    blocks[10:12, :, 16:] = 0x00
    x = np.where(rng.random((6, k)) < 0.5, -3.0, 3.0).astype(np.float32)
    _check(_run("numpy", x, w, "Q4_K", variant="per256"), x, w, "Q4_K", 1e-5, "per256")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("target", TARGETS)
def test_quantize_x256(target, split, rng):
    """One scale per 256 elements (max|x| / 127), q rounded half to even, and sum(q) per 32 (fp32, or split into
    fp16 pairs 64 floor(s / 64), s mod 64 that add up to it exactly); a zero block."""
    x = rng.standard_normal((3, 768)).astype(np.float32)
    x[1, 256:512] = 0
    x[2, :32] = 5.0  # sum(q) 4064: beyond fp16's exact integers unless split
    xq, xd, xs = (host(a) for a in sb.quantize_x256(dev(x, target), target=target, split=split))
    q, d = sb.quantize_x256_ref(x)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_array_equal(xd, np.abs(x).reshape(3, 3, 256).max(-1).astype(np.float32) * np.float32(1 / 127))
    sums = q.reshape(3, -1, 32).astype(np.int64).sum(-1)
    if split:
        assert xs.dtype == np.float16 and ((xs[:, 1::2] >= 0) & (xs[:, 1::2] < 64) & (xs[:, ::2] % 64 == 0)).all()
        xs = xs[:, ::2].astype(np.int64) + xs[:, 1::2].astype(np.int64)
    np.testing.assert_array_equal(xs, sums)
    assert sums[2, 0] == 4064 and (xd[1, 1] == 0) and not q[1, 256:512].any()


def test_per256_error_is_the_coarser_group():
    """The bound of one scale a super-block is above per32's (Gaussian x: about 1.2-1.4x) and mmq's error is within
    it: what x's coarser quantization costs, stated."""
    rng = np.random.default_rng(7)
    w = padded_weights(rng, "Q4_K", 64, 1024)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    b32, b256 = (int8_error_bound(x, w, "Q4_K", g).mean() for g in (32, 256))
    assert 1.1 < b256 / b32 < 1.6
    exact = dgm.dequant_matmul_ref(x, w, "Q4_K")
    errs = [np.abs(mq.mmq(x, w, "Q4_K", variant=v) - exact).mean() for v in ("per32", "per256")]
    assert errs[0] < errs[1] < b256


_words = sb._scale_words


def _no_top_bits(words):
    s = _words(words)
    return (s[0], s[1] & 0x0F0F0F0F, s[2], s[3])


PLANTED = {  # a bug of the per256 kernel -> how it is planted
    "scales and mins swapped": lambda mp, x: (mp.setattr(sb, "_scale_words", lambda w: _words(w)[2:] + _words(w)[:2]),
                                              None)[1],
    "scales 4-7 without their top bits": lambda mp, x: (mp.setattr(sb, "_scale_words", _no_top_bits), None)[1],
    "high nibbles' offset left out": lambda mp, x: (mp.setattr(sb, "_high_nibbles", lambda v: v & 0xF0), None)[1],
    # per32's pre-pass with per256's shapes (d repeated over each super-block's 8 blocks: right shapes, wrong scale)
    "x scaled per 32": lambda mp, x: (lambda q, d, s: (q, d[:, ::8].copy(), s))(*quantize_x(x, sums=True)),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_per256_planted_bug_fails(bug, rng, monkeypatch):
    w = padded_weights(rng, "Q4_K", 40, 512)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    monkeypatch.setattr(dsl_launch, "_kernels", {})  # traced afresh with the bug, forgotten after
    monkeypatch.setattr(dsl_launch, "_compiled", {})
    pre = PLANTED[bug](monkeypatch, x)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        _check(_run("numpy", x, w, "Q4_K", variant="per256", xq=pre), x, w, "Q4_K", 1e-5, "per256")


@pytest.mark.parametrize("target", TARGETS)
def test_quantize_x_sums(target, rng):
    """The pre-pass's third output is d * sum(q) per 32 elements (a block's minimum meets it)."""
    x = rng.standard_normal((3, 256)).astype(np.float32)
    xq, xd, xs = (host(a) for a in quantize_x(dev(x, target), target=target, sums=True))
    q, d = quantize_x_ref(x)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_allclose(xs, d * q.reshape(3, -1, 32).astype(np.float32).sum(-1), rtol=1e-6)


def test_a_pre_pass_of_another_layout_is_refused(rng):
    """A given pre-pass whose shapes are not the layout the tiles read is an error, not wrong numbers: per32's for
    per256, and per256's fp32 sums where Q4_K's 32-row tiles read split fp16 pairs."""
    w = padded_weights(rng, "Q4_K", 40, 512)
    x = rng.standard_normal((20, 512)).astype(np.float32)
    with pytest.raises(ValueError, match="is not the per256-split pre-pass"):
        mq.mmq(x, w, "Q4_K", variant="per256", xq=sb.quantize_x256(x))
    with pytest.raises(ValueError, match="is not the per256-split pre-pass"):
        mq.mmq(x, w, "Q4_K", variant="per256", xq=quantize_x(x, sums=True))
    assert mq.x_layout("Q4_K", 20, 40, 512, "per256") == "per256-split"
    assert mq.x_layout("Q6_K", 20, 40, 512, "per256") == mq.x_layout("Q4_K", 9, 40, 512, "per256") == "per256"
    np.testing.assert_array_equal(mq.mmq(x, w, "Q4_K", variant="per256", xq=sb.quantize_x256(x, split=True)),
                                  mq.mmq(x, w, "Q4_K", variant="per256"))


def test_mmq_takes_a_shared_pre_pass(rng):
    """xq: one quantize_x triple serves several GEMMs of the same input, with the same result."""
    w = padded_weights(rng, "Q4_K", 20, 512)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    pre = quantize_x(x, sums=True)  # per32's pre-pass (per256's is gguf_mmq_sb.pre_pass)
    np.testing.assert_array_equal(mq.mmq(x, w, "Q4_K", xq=pre, variant="per32"), mq.mmq(x, w, "Q4_K", variant="per32"))


def test_mmq_errors(rng):
    w = padded_weights(rng, "Q4_K", 4, 512)
    x = np.zeros((5, 512), np.float32)
    with pytest.raises(ValueError, match="unsupported qtype"):
        mq.mmq(x, w, "Q8_0")
    with pytest.raises(ValueError, match="do not make a GEMM"):
        mq.mmq(np.zeros((5, 768), np.float32), w, "Q4_K")
    big = np.zeros((4, 2 * 288 + 2), np.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        mq.mmq(x, big[:, 2:], "Q4_K")
    assert mq.mmq(np.zeros((0, 512), np.float32), w, "Q4_K").shape == (0, 4)


def test_mmq_tiles_rule_and_tuned(monkeypatch):
    """The rule fills the GPU within the partials' budget; a MMQ_TUNED entry replaces it for its problem only."""
    t = mq.mmq_tiles("Q4_K", 16, 4096, 14336)
    assert t["SPLIT"] > 1 and 8 * t["SPLIT"] * 16 * 4096 <= split_k.PART_BYTES
    assert mq.mmq_tiles("Q4_K", 64, 100, 512)["BLOCK_M"] == 64
    monkeypatch.setitem(mq.MMQ_TUNED, ("Q6_K", 16, 300, 512), dict(block_n=128, split_k=1, num_stages=2))
    t = mq.mmq_tiles("Q6_K", 12, 300, 512, variant="per32")  # an entry naming no variant is per32's
    assert (t["BLOCK_N"], t["SPLIT"], t["num_stages"], t["variant"]) == (128, 1, 2, "per32")
    assert mq.mmq_tiles("Q6_K", 12, 300, 512)["BLOCK_N"] == 64  # not the default variant's (per256)
    assert mq.mmq_tiles("Q6_K", 12, 301, 512, variant="per32")["BLOCK_N"] == 64


def test_mmq_tiles_variant(monkeypatch):
    """MMQ_TUNED may name the variant of its problem; asking for the other one drops its entry; per256 at 64 rows
    takes 8 warps."""
    monkeypatch.setitem(mq.MMQ_TUNED, ("Q4_K", 32, 300, 512), dict(variant="per256", block_n=128, num_warps=4))
    assert mq.mmq_tiles("Q4_K", 30, 300, 512)["variant"] == "per256"
    t = mq.mmq_tiles("Q4_K", 30, 300, 512, variant="per32")
    assert (t["variant"], t["BLOCK_N"], t["num_warps"]) == ("per32", 64, 4)
    assert mq.mmq_tiles("Q4_K", 40, 301, 512, variant="per256")["num_warps"] == 8
    assert mq.mmq_tiles("Q4_K", 30, 301, 512, variant="per256")["num_warps"] == 4
    with pytest.raises(ValueError, match="unknown variant 'per64'"):
        mq.mmq(np.zeros((4, 512), np.float32), np.zeros((2, 288), np.uint8), "Q4_K", variant="per64")


def _int_dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    i, j, kk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + i[:, None] * K + kk[None, :])
    y = tl.load(b + kk[:, None] * N + j[None, :])
    tl.store(c + i[:, None] * N + j[None, :], tl.dot(x, y))


@pytest.mark.parametrize("target", [*TARGETS, "simt-cpu"])
def test_dsl_int8_dot(target, rng):
    """int8 @ int8 is exact in int32 on every target, the extremes included."""
    a = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (64, 32), dtype=np.int8)
    a[0], b[:, 0] = -128, -128
    c = dev(np.zeros((16, 32), np.int32), target)
    dsl_compile(_int_dot_kernel, target, M=16, N=32, K=64)[1](dev(a, target), dev(b, target), c)
    np.testing.assert_array_equal(host(c), a.astype(np.int64) @ b.astype(np.int64))


def test_dsl_int8_dot_needs_k_32():
    from kernels_src.dsl.tracer import TraceError

    with pytest.raises(TraceError, match="K >= 32"):
        dsl_compile(_int_dot_kernel, "numpy", M=16, N=16, K=16).trace(
            signature=dict(a="*i8", b="*i8", c="*i32"))


SASS_LIMIT = {"per32": 950, "per32p": 740, "per256": 600}


@needs_aot
@pytest.mark.parametrize("qtype,m,n,k,variant,loop_stages", [
    (q, m, n, k, v, 0)
    for q, m, n, k in [("Q4_K", 16, 14336, 4096), ("Q6_K", 16, 4096, 14336), ("Q4_K", 32, 4096, 4096)]
    for v in mq.VARIANTS if q == "Q4_K" or v != "per32p"]  # per32p's Q6_K is per32's
    + [("Q4_K", 64, 14336, 4096, "per256", 0),  # per32 spills at 64 rows (not sent there)
       ("Q4_K", 16, 14336, 4096, "per256", 3)])  # the K loop pipelined (LLM_ENGINE_MMQ_LOOP_STAGES)
def test_aot_sm90(qtype, m, n, k, variant, loop_stages, tmp_path, monkeypatch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function
    from tools.sass_mix import loop_mix

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mq, "MMQ_TUNED", {})  # the rule's 64-wide tile: what the instruction ceilings count
    cfg = mq.mmq_tiles(qtype, m, n, k, variant=variant) | {"LOOP_STAGES": loop_stages}
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages") or 3, cfg.pop("SPLIT")
    cfg.pop("variant")
    kern = dsl_compile(mq._variant(variant)[0][qtype], "triton", PDL=True, **cfg)
    split_sums = variant == "per256" and qtype == "Q4_K" and m >= sb.MMA_MINS_ROWS
    sig = dict(w="*u8", xq="*i8", xd="*fp32", xs="*fp16" if split_sums else "*fp32",
               y="*bf16" if split == 1 else "*fp32")
    kir = kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig})
    div16 = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kir.params)
             if p.name in ("w", "xq", "xd", "xs", "y", "w_stride", "xq_stride", "xs_stride", "y_stride")}
    fn = JITFunction(load_function(TritonRenderer().render(kir), kir.name))
    c = triton.compile(ASTSource(fn, signature=kir.signature, attrs=div16), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": nw, "num_stages": ns})
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".s8.s8" in ptx and "griddepcontrol.wait" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
    if (qtype, m) == ("Q4_K", 16):  # the speed proxy: instructions a super-block (per32 891, per32p ~710, per256 ~560)
        mix = loop_mix(c.asm["cubin"])
        assert mix.opcodes["IGMMA"] == 8 and mix.instructions <= SASS_LIMIT[variant]
        assert variant == "per32" or mix.opcodes["PRMT"] <= 4  # no byte-by-byte unpacking
        assert variant != "per256" or mix.opcodes["I2FP"] <= 8  # no int-to-float conversion a sub-block
        if variant == "per256":  # plain, W's loads are waited for in their own step; pipelined, cp.async ahead
            assert (mix.opcodes["LDG"] == 0 < mix.opcodes["LDGSTS"]) if loop_stages else mix.opcodes["LDG"] >= 16


@needs_aot
def test_dump_kernel_sass_mix(capsys):
    """tools/dump_kernel --target sass-mix: the main loop's instruction mix of the sm_90 build."""
    from tools.dump_kernel import main

    assert main(["mmq_sb_q6_k", "--target", "sass-mix"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("main loop: ") and "IGMMA 16" in out and "stack 0" in out


def test_sweep_mmq_settings():
    """tools/sweep_mmq tries every variant asked for, 8 warps with 64-column tiles only for per256 at 64 rows, the K
    loop plain and pipelined, and refuses an unknown variant by name before looking for a GPU."""
    from tools.sweep_mmq import _settings, main

    for m in (16, 64):
        got = list(_settings({"SPLIT": 4}, list(mq.VARIANTS), m))
        assert {c["variant"] for c in got} == set(mq.VARIANTS) and all(c["split_k"] >= 1 for c in got)
        narrow8 = {c["variant"] for c in got if c["num_warps"] == 8 and c["block_n"] == 64}
        assert narrow8 == (set() if m == 16 else {"per256"})
        assert {c["loop_stages"] for c in got} == {0, 2, 3}  # the K loop plain, then pipelined (gguf_mmq.LOOP_STAGES)
        assert all(c["loop_stages"] == 0 or c["num_stages"] == 3 for c in got)
    with pytest.raises(SystemExit, match="--variants takes per32, per32p, per256, got 'per64'"):
        main(["--variants", "per64"])
