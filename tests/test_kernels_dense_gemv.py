"""The dense GEMV with its prologues (rms_norm, add_rms_norm, gated) and residual epilogue: the DSL interpreter and
Triton's interpreter against the numpy reference on poisoned outputs, N and K off the tiles, M = 1, 3, 8, strided
rows and a separate up; add_rms_norm's sum exactly as the unfused kernel rounds it; bf16 on the DSL interpreter
(Triton's mishandles bf16); the SIMT oracle; Triton AOT builds for sm_90 without spills."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot

from kernels_src import dense_gemv as dg
from kernels_src.registry import REGISTRY

TOL = {np.float32: 1e-5, np.float16: 3e-3}  # of the largest |y|: the output's rounding, sums of up to ~1000 terms


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def inputs(rng, m, n, k, prologue, dtype, residual=False, offset=False, act="silu"):
    """(x, w, prologue, epilogue residual) in numpy: W scaled so y stays near 1; x [m, 2k] for the gated one."""
    x = rng.standard_normal((m, 2 * k if prologue == "gated" else k)).astype(dtype)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype)
    g = (1 + 0.1 * rng.standard_normal(k)).astype(dtype)
    pro = {"none": None, "rms_norm": dg.RMSNorm(g, 1e-5, offset),
           "add_rms_norm": dg.AddRMSNorm(rng.standard_normal((m, k)).astype(dtype), g, 1e-6, offset),
           "gated": dg.Gated(act)}[prologue]
    return x, w, pro, rng.standard_normal((m, n)).astype(dtype) if residual else None


def on(target, pro, sum_out=None):
    """The prologue with its arrays as the target takes them."""
    if isinstance(pro, dg.AddRMSNorm):
        return dg.AddRMSNorm(dev(pro.residual, target), dev(pro.w, target), pro.eps, pro.offset, sum_out)
    if isinstance(pro, dg.RMSNorm):
        return dg.RMSNorm(dev(pro.w, target), pro.eps, pro.offset)
    return pro


def close(got, want, dtype):
    got = host(got).astype(np.float32)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def run(target, x, w, pro, res, dtype, **tiles):
    """dense_gemv into poisoned outputs; y (and the sum) against the reference, the sum bit for bit."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    out = dev(np.full((m, n), np.nan, dtype), target)
    s_out = dev(np.full((m, k), np.nan, dtype), target) if isinstance(pro, dg.AddRMSNorm) else None
    got = dg.dense_gemv(dev(x, target), dev(w, target), prologue=on(target, pro, s_out),
                        residual=None if res is None else dev(res, target), out=out, target=target, **tiles)
    want = dg.dense_gemv_ref(x, w, pro, res)
    if s_out is None:
        assert got is out
        close(out, want, dtype)
    else:
        assert got[0] is s_out and got[1] is out
        np.testing.assert_array_equal(host(s_out), want[0])  # rounded to x's dtype, as add_rms_norm writes it
        close(out, want[1], dtype)


# (m, n, k, prologue, extras): N and K off the tiles, one step or several, EVEN_K, rows a program not a power of two
CASES = [
    (1, 37, 515, "none", {}),
    (8, 13, 200, "none", dict(residual=True)),
    (3, 9, 300, "rms_norm", dict(offset=True)),
    (8, 5, 1001, "add_rms_norm", {}),
    (1, 6, 64, "add_rms_norm", dict(residual=True, offset=True)),
    (3, 11, 257, "gated", {}),
    (1, 7, 130, "gated", dict(act="gelu_tanh", residual=True)),
    (3, 10, 512, "add_rms_norm", dict(tiles=dict(rows=3, block_k=64, num_warps=1))),  # 8 steps, no masks
    (8, 9, 300, "gated", dict(act="gelu", tiles=dict(rows=2, block_k=128, num_warps=2))),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m,n,k,prologue,extra", CASES, ids=[f"m{c[0]}-{c[3]}-{c[1]}x{c[2]}" for c in CASES])
def test_dense_gemv(target, dtype, m, n, k, prologue, extra, rng):
    extra = dict(extra)
    tiles = extra.pop("tiles", {})
    run(target, *inputs(rng, m, n, k, prologue, dtype, **extra), dtype, **tiles)


def test_strided_rows_and_a_separate_up(rng):
    """x, w and y rows at odd strides (w's row stride not K), gate and up as two views of one wider buffer."""
    m, n, k = 3, 10, 150
    big = rng.standard_normal((m, 2 * k + 5)).astype(np.float32)
    gate, up = big[:, :k], big[:, k + 3:2 * k + 3]
    w = (rng.standard_normal((n, k + 9)) / np.sqrt(k)).astype(np.float32)[:, :k]
    out = np.full((m, n + 3), np.nan, np.float32)[:, :n]
    dg.dense_gemv(gate, w, prologue=dg.Gated("silu", up), out=out)
    close(out, dg.dense_gemv_ref(gate, w, dg.Gated("silu", up)), np.float32)
    x, _, pro, _ = inputs(rng, m, n, k, "add_rms_norm", np.float32)
    xs = np.repeat(x, 2, axis=0)[::2]  # rows at twice their length apart
    s, y = dg.dense_gemv(xs, w, prologue=pro, rows=2, block_k=32)
    s_ref, y_ref = dg.dense_gemv_ref(x, w, pro)
    np.testing.assert_array_equal(s, s_ref)
    close(y, y_ref, np.float32)


def test_vector_x_and_refusals(rng):
    k = 40
    x, w, pro, _ = inputs(rng, 1, 6, k, "add_rms_norm", np.float32)
    s, y = dg.dense_gemv(x[0], w, prologue=dg.AddRMSNorm(pro.residual[0], pro.w, pro.eps))
    s_ref, y_ref = dg.dense_gemv_ref(x, w, pro)
    assert s.shape == (k,) and y.shape == (6,)
    close(y, y_ref[0], np.float32)
    np.testing.assert_array_equal(s, s_ref[0])
    close(dg.dense_gemv(x[0], w, residual=np.ones(6, np.float32)), dg.dense_gemv_ref(x, w)[0] + 1, np.float32)
    with pytest.raises(ValueError, match="1-8 rows"):
        dg.dense_gemv(np.zeros((9, k), np.float32), w)
    with pytest.raises(ValueError, match="1-8 rows"):
        dg.dense_gemv(x, w[:, :-1])
    with pytest.raises(ValueError, match="may not alias"):  # other programs would read what program 0 wrote
        dg.dense_gemv(x, w, prologue=dg.AddRMSNorm(pro.residual, pro.w, 1e-6, sum_out=x))
    with pytest.raises(ValueError, match="residual is"):
        dg.dense_gemv(x, w, residual=np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError, match="unknown activation"):
        dg.dense_gemv(np.zeros((1, 2 * k), np.float32), w, prologue=dg.Gated("relu"))
    with pytest.raises(ValueError, match="power of two"):
        dg.dense_gemv(x, w, block_k=96)


@pytest.mark.parametrize("prologue", ["none", "rms_norm", "add_rms_norm", "gated"])
def test_bf16(prologue, rng):
    """bf16 x, w, y on the DSL interpreter (through CPU torch tensors); the sum rounded as torch rounds it."""
    torch = pytest.importorskip("torch")
    m, n, k = 3, 9, 200
    x, w, pro, _ = inputs(rng, m, n, k, prologue, np.float32)
    bf = lambda a: torch.from_numpy(a).bfloat16()
    tpro = {"rms_norm": lambda p: dg.RMSNorm(bf(p.w), p.eps), "add_rms_norm": lambda p: dg.AddRMSNorm(
        bf(p.residual), bf(p.w), p.eps)}.get(prologue, lambda p: p)(pro)
    got = dg.dense_gemv(bf(x), bf(w), prologue=tpro)
    fl = lambda t: t.float().numpy()
    hpro = {"rms_norm": lambda p: dg.RMSNorm(fl(p.w), p.eps), "add_rms_norm": lambda p: dg.AddRMSNorm(
        fl(p.residual), fl(p.w), p.eps)}.get(prologue, lambda p: p)(tpro)
    want = dg.dense_gemv_ref(fl(bf(x)), fl(bf(w)), hpro)
    if prologue == "add_rms_norm":
        s_want = (bf(x).float() + tpro.residual.float()).bfloat16()
        assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], s_want)
        got, want = got[1], dg.dense_gemv_ref(fl(s_want), fl(bf(w)), dg.RMSNorm(hpro.w, hpro.eps))
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(fl(got), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("prologue,residual", [("none", True), ("rms_norm", False), ("add_rms_norm", True),
                                               ("gated", False), ("gated", True)])
def test_planned_launches(prologue, residual, rng):
    """Torch tensors of the same shapes launch through the plan their first call made (an eager step's fused
    GEMVs): every later call's own arrays, not the first's, against the reference; the sum a new tensor each time."""
    torch = pytest.importorskip("torch")
    m, n, k = 1, 9, 200
    tt = lambda a: None if a is None else torch.from_numpy(a)
    got, want, sums = [], [], []
    for _ in range(3):
        x, w, pro, res = inputs(rng, m, n, k, prologue, np.float32, residual=residual)
        if prologue == "gated":  # the runner's gated chain: gate and up, the halves of one gate_up output
            pro, x = dg.Gated(pro.act, tt(x[:, k:])), x
            x_t = tt(x)[:, :k]
            ref = dg.dense_gemv_ref(x[:, :k], w, dg.Gated(pro.act, x[:, k:]), res)
        else:
            x_t = tt(x)
            ref = dg.dense_gemv_ref(x, w, pro, res)
            pro = {"rms_norm": lambda p: dg.RMSNorm(tt(p.w), p.eps), "add_rms_norm": lambda p: dg.AddRMSNorm(
                tt(p.residual), tt(p.w), p.eps)}.get(prologue, lambda p: p)(pro)
        y = dg.dense_gemv(x_t, tt(w), prologue=pro, residual=tt(res))
        if prologue == "add_rms_norm":
            np.testing.assert_array_equal(y[0].numpy(), ref[0])
            sums.append(y[0])
            y, ref = y[1], ref[1]
        got.append(y.numpy())
        want.append(ref)
    for g, r in zip(got, want, strict=True):
        close(g, r, np.float32)
    assert len({s.data_ptr() for s in sums}) == len(sums)


@pytest.mark.parametrize("prologue", ["none", "add_rms_norm"])
def test_planned_launches_into_callers_buffers(prologue, rng):
    """A caller's out (and AddRMSNorm's sum_out; an eager step's kept buffers), contiguous or the rows of a wider
    buffer, each filled with NaN first: a later call of the same shapes goes through the plan of its buffers' strides,
    written where asked, against the reference."""
    torch = pytest.importorskip("torch")
    m, n, k = 2, 9, 200
    for wide in (False, True, False, True):  # each kind of buffer twice: the second through the first's plan
        x, w, pro, _ = inputs(rng, m, n, k, prologue, np.float32)
        ref = dg.dense_gemv_ref(x, w, pro)
        pad = 5 if wide else 0
        out = torch.full((m, n + pad), float("nan"))[:, :n]
        s_out = torch.full((m, k + pad), float("nan"))[:, :k] if prologue == "add_rms_norm" else None
        tpro = None if pro is None else dg.AddRMSNorm(torch.from_numpy(pro.residual), torch.from_numpy(pro.w),
                                                      pro.eps, sum_out=s_out)
        y = dg.dense_gemv(torch.from_numpy(x), torch.from_numpy(w), prologue=tpro, out=out)
        if s_out is not None:
            assert y[0] is s_out
            np.testing.assert_array_equal(s_out.numpy(), ref[0])
            y, ref = y[1], ref[1]
        assert y is out
        close(out.numpy(), ref, np.float32)


@pytest.mark.parametrize("m,prologue,extra", [(3, "add_rms_norm", dict(residual=True)), (1, "gated", {})])
def test_simt_oracle(m, prologue, extra, rng):
    """The SIMT lowering (the Metal and CUDA C targets' form) on the CPU oracle: one warp of fibers a program."""
    x, w, pro, res = inputs(rng, m, 7, 100, prologue, np.float32, **extra)
    run("simt-cpu", x, w, pro, res, np.float32, block_k=128, num_warps=1)


def test_default_tiles():
    for (n, k, m, p), t in dg.TILES.items():
        assert m in (1, 4, 8) and p in dg.PROLOGUES and set(t) == {"ROWS", "BLOCK_K", "num_warps"}, (n, k, m, p)
    for m in range(1, 9):
        for p in dg.PROLOGUES:
            t = dg.default_tiles(4096, 14336, m, p)
            assert 1 <= t["ROWS"] <= 16 and t["BLOCK_K"] & (t["BLOCK_K"] - 1) == 0 and t["num_warps"] in (1, 2, 4, 8)


@needs_aot
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "add_rms_norm", "gated"])
@pytest.mark.parametrize("m", [1, 8])
def test_aot_sm90(prologue, m, tmp_path, monkeypatch):
    """Default tiles at phi-3's shapes build for sm_90 with 16-byte loads of W and x, spilling nothing (the PDL build of
    each entry: test_kernels_pdl.py's test_aot_sm90). M = 8 in fp16 with the residual epilogue, M = 1 in bf16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry = REGISTRY["dense_gemv" + ("" if prologue == "none" else f"_{prologue}")]
    n, k = {"none": (3072, 3072), "rms_norm": (9216, 3072), "add_rms_norm": (16384, 3072),
            "gated": (3072, 8192)}[prologue]
    tiles = dg.default_tiles(n, k, m, prologue)
    nw = tiles.pop("num_warps")
    dt = "*fp16" if m > 1 else "*bf16"
    sig = {p: dt for p in ("x", "x2", "g", "s_out", "r", "w", "y")}
    k_ir = entry.trace(signature=sig, M=m, RESIDUAL=m > 1, EVEN_K=k % tiles["BLOCK_K"] == 0, **tiles)
    fn = JITFunction(load_function(TritonRenderer().render(k_ir), k_ir.name))
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(k_ir.params) if p.name != "eps"}
    compiled = triton.compile(ASTSource(fn, signature=k_ir.signature, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx and ptx.count("ld.global.v4") >= tiles["ROWS"] + m
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0


def test_sweep_runs_on_the_interpreter(monkeypatch, capsys):
    """tools/sweep_dense_gemv's check, timing and report on the DSL interpreter (CPU tensors, a fake clock): what a
    GPU run executes, on small shapes."""
    torch = pytest.importorskip("torch")
    from tools import sweep_dense_gemv as sweep
    from tools.kernel_case_base import Dev

    monkeypatch.setattr(sweep, "TARGET", "numpy")
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "STEPS", ((256, 1), (512, 2)))
    assert sweep._check_one(4, sweep.settings(4)[1], "add_rms_norm", 96) is None
    d = Dev(0, "cpu")
    cases = [sweep.Case(torch, d, [d.randn((16, 64), torch.bfloat16) for _ in range(2)], name, m, p)
             for name, p in (("o", "none"), ("qkv", "add_rms_norm"), ("down", "gated")) for m in (1, 8)]
    clock = iter(range(1, 10**6))
    skipped = sweep._time(cases, {}, lambda fn: (fn(), float(next(clock)))[1], budget=1e9, t0=0.0, quick=False)
    table = sweep._report(cases, 1000.0)
    assert skipped == 0 and "down" in capsys.readouterr().out
    assert table[(16, 64, 8, "gated")] == sweep._s(min(cases[-1].us["fused"], key=cases[-1].us["fused"].get))
    assert set(table) == {(16, 64, m, p) for m in (1, 8) for p in ("none", "add_rms_norm", "gated")}
