"""The one-row GEMVs' K loop in its other forms (kernels_src/gemv_loop.py: the next step's W carried in registers,
`prefetch`, or Triton's pipelining over `stages`): dequant_gemv (both paths, Q6_K's word loader), int_group_gemv_i8
and fp8_gemv give the plain loop's outputs exactly and stay within their references' bounds on both interpreters, at
one step, at several with a partial last one, and with ROWS not dividing N; a prefetch one step off fails the same
checks; the SIMT lowering runs the prefetch loop; bad keys are named; the sweeps carry the forms; the sm_90 builds: no
spills, and under stages W's loads are cp.async issued after the PDL wait."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, TOL, dev, host
from test_kernels_fp8_gemv import check_gemv
from test_kernels_fp8_gemv import weights as fp8_weights
from test_kernels_gemv import needs_aot, padded_weights
from test_kernels_int_group import blocks
from test_kernels_int_group_i8 import _check as check_int_group

from kernels_src import dequant_gemv as dg
from kernels_src import dequant_gemv_i8 as dgi
from kernels_src import fp8_gemv as fg
from kernels_src import gemv_loop
from kernels_src import int_group_gemv as ig
from kernels_src.dsl import launch as dsl_launch
from kernels_src.dsl import tl
from kernels_src.dsl.tracer import TraceError

FORMS = [dict(prefetch=True), dict(stages=2)]


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def gguf(target, x, w, qtype, **kw):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, np.float32), target)
    dg.dequant_gemv(dev(x, target), dev(w, target), qtype, out=out, target=target, **kw)
    return host(out).astype(np.float64)


def gguf_bound(x, w, qtype, int8_x):
    want = dg.dequant_gemv_ref(x, w, qtype).astype(np.float64)
    i8 = dgi.int8_error_bound(x, w, qtype) if int8_x else 0
    return want, i8 + TOL[np.float32]["rtol"] * 10 * np.abs(want).max()


# (qtype, M, N, blocks, tiles): one step (1 block, STEP 4); 3 steps, the last partial, ROWS 2 over N 3; Q6_K's word
# loader over 2 steps (6 blocks); the fp32 path (int8_x False) for a k-quant and a 32-element format
GGUF_CASES = [("Q4_K", 1, 5, 1, dict(rows=2, step=4, int8_x=True)),
              ("Q4_K", 2, 3, 5, dict(rows=2, step=2, int8_x=True)),
              ("Q6_K", 1, 5, 6, dict(rows=4, step=4, int8_x=True, words=True)),
              ("Q5_K", 1, 3, 3, dict(rows=2, step=2, int8_x=False)),
              ("Q8_0", 3, 5, 20, dict(rows=2, step=8, parts=2))]


def _on_both(cases: list) -> list:
    """Every case on the DSL's interpreter, the first also on Triton's (which takes ~5-20 s a case here)."""
    skip = pytest.mark.skipif(not HAS_TRITON, reason="Triton's interpreter needs triton and torch")
    return [("numpy", *c) for c in cases] + [pytest.param("triton-interpret", *cases[0], marks=skip)]


@pytest.mark.parametrize("target,qtype,m,n,nblk,tiles", _on_both(GGUF_CASES))
def test_gguf_forms_match_the_plain_loop(target, qtype, m, n, nblk, tiles, rng):
    k = nblk * dg.FORMATS[qtype][0]
    w = padded_weights(rng, qtype, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    plain = gguf(target, x, w, qtype, **tiles)
    want, bound = gguf_bound(x, w, qtype, tiles.get("int8_x"))
    assert np.isfinite(plain).all() and (np.abs(plain - want) <= bound).all()
    for form in FORMS:
        np.testing.assert_array_equal(gguf(target, x, w, qtype, **tiles, **form), plain, err_msg=str(form))


@pytest.mark.parametrize("target,bits,group,k,m,n,tiles", _on_both([
    (4, 128, 128, 1, 4, {}),  # one group a row: one step
    (4, 64, 512, 2, 5, dict(lanes=4, rows=2)),  # 5 steps of 4 vectors
    (8, 32, 160, 3, 3, dict(lanes=4, rows=2))]))  # 8-byte vectors: 4 steps, the last partial; ROWS 2 over N 3
def test_int_group_forms_match_the_plain_loop(target, bits, group, k, m, n, tiles, rng):
    """The plain loop within the int8 path's references (check_int_group), each form its y exactly."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = blocks(rng, n, k, bits, group)
    check_int_group(x, w, bits, group, target, **tiles, prefetch=False, stages=0)
    ys = []
    for form in [dict(prefetch=False, stages=0)] + FORMS:
        out = dev(np.full((m, n), np.nan, np.float32), target)
        ig.int_group_gemv(dev(x, target), dev(w, target), bits, group, out=out, target=target, int8_x=True,
                          **tiles, **form)
        ys.append(host(out))
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


@pytest.mark.parametrize("target", TARGETS)  # fp8's cases are cheap on Triton's interpreter too
@pytest.mark.parametrize("group,k,tiles", [(16, 64, dict(block_k=64, rows=1)),  # one step, EVEN_K
                                           (16, 80, dict(block_k=32, rows=3)),  # 3 steps, the last partial
                                           (32, 256, dict(block_k=64, rows=2))])  # 4 steps, EVEN_K: clamped
def test_fp8_forms_match_the_plain_loop(target, group, k, tiles, rng):
    """W exactly [N, K] (no padding past the last row: a prefetch past it would read outside the array)."""
    codes, scales = fp8_weights(rng, 5, k, group)
    x = rng.standard_normal((2, k)).astype(np.float32)
    out = lambda **kw: _fp8(target, x, codes, scales, **tiles, **kw)
    plain = out()
    check_gemv(plain, x, codes, scales, group)
    for form in FORMS:
        np.testing.assert_array_equal(out(**form), plain, err_msg=str(form))


def test_prefetch_on_the_simt_fiber_oracle(rng):
    """The SIMT lowering (the Metal / CUDA C emitters' form, run by the C++ fiber oracle) of the prefetch loop, which
    a GPU's table may hand every target: the plain loop's outputs exactly."""
    w = padded_weights(rng, "Q4_K", 3, 768)
    x = rng.standard_normal((1, 768)).astype(np.float32)
    plain = gguf("simt-cpu", x, w, "Q4_K", rows=2, step=2)
    np.testing.assert_array_equal(gguf("simt-cpu", x, w, "Q4_K", rows=2, step=2, prefetch=True, stages=2), plain)


def _fp8(target, x, codes, scales, **kw):
    y = dev(np.full((x.shape[0], codes.shape[0]), np.nan, np.float32), target)
    fg.fp8_gemv(dev(x, target), dev(codes, target), dev(scales, target), out=y, target=target, **kw)
    return host(y).astype(np.float64)


def test_a_prefetch_one_step_off_fails(rng, monkeypatch):
    """A prefetch that loads step it again (step 0 twice, the last never) fails the reference checks."""
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(gemv_loop, "_next_step", lambda it, n_steps: it)
    codes, scales = fp8_weights(rng, 3, 96, 16)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    with pytest.raises(AssertionError):
        check_gemv(_fp8("numpy", x, codes, scales, block_k=32, prefetch=True), x, codes, scales, 16)
    w = padded_weights(rng, "Q4_K", 3, 768)
    x = rng.standard_normal((1, 768)).astype(np.float32)
    want, bound = gguf_bound(x, w, "Q4_K", True)
    assert (np.abs(gguf("numpy", x, w, "Q4_K", rows=1, step=1, int8_x=True, prefetch=True) - want) > bound).any()


def test_bad_loop_keys_are_named(rng):
    tiles = dict(ROWS=1, STEP=4, PARTS=1, num_warps=1)
    with pytest.raises(ValueError, match=r"prefetch 1 \(a bool\)"):
        dg.check_tiles("Q4_K", tiles | {"prefetch": 1})
    with pytest.raises(ValueError, match=r"stages 1 \(0, or 2 to 4\)"):
        dg.check_tiles("Q4_K", tiles | {"stages": 1})
    codes, scales = fp8_weights(rng, 2, 32, 16)
    with pytest.raises(ValueError, match=r"stages 7 \(0, or 2 to 4\)"):
        fg.fp8_gemv(np.ones((1, 32), np.float32), codes, scales, stages=7)
    w = blocks(rng, 2, 128, 4, 128)
    with pytest.raises(ValueError, match="only the int8-activation path"):
        ig.int_group_gemv(np.ones((1, 128), np.float32), w, 4, 128, int8_x=False, prefetch=True)

    def kern(y):
        tl.fori_loop(0, 4, lambda i: (), stages=1)

    with pytest.raises(TraceError, match="stages 1"):
        dsl_launch.compile(kern, "numpy").trace(signature=dict(y="*fp32"))


def test_tables_pick_the_form(rng, monkeypatch):
    """A TUNED entry's prefetch / stages reach the kernel: the compiled kernels' constexprs say so."""
    w = padded_weights(rng, "Q4_K", 3, 256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setitem(dg.TUNED, ("Q4_K", 1, 3, 256), dict(ROWS=1, STEP=4, PARTS=1, num_warps=1, prefetch=True,
                                                            stages=2))
    gguf("numpy", x, w, "Q4_K", int8_x=True)
    codes, scales = fp8_weights(rng, 3, 64, 16)
    monkeypatch.setitem(fg.TUNED, (16, 1, 3, 64), dict(ROWS=2, BLOCK_K=32, num_warps=1, prefetch=True, stages=3))
    _fp8("numpy", x[:, :64], codes, scales)
    consts = [k.constexprs for k in dsl_launch._kernels.values()]
    assert any(c.get("QTYPE") == "Q4_K" and c["PREFETCH"] and c["STAGES"] == 2 for c in consts), consts
    assert any(c.get("BLOCK_K") == 32 and c["PREFETCH"] and c["STAGES"] == 3 for c in consts), consts


def test_the_sweeps_carry_the_forms():
    from tools import bench_int_group_gemm as big
    from tools import sweep_fp8_gemv as sf
    from tools import sweep_gemv as sg

    ess = sg.essentials("Q4_K", 1, 28672, 4096)
    rule = dg.rule_tiles("Q4_K", 1, 28672)
    assert all(rule | f in ess for f in sg.LOOP_FORMS) and all(sg._s(sg._t(s)) == s for s in ess)
    q6 = sg.essentials("Q6_K", 1, 4096, 14336)
    assert dg.rule_tiles("Q6_K", 1, 4096) | {"words": True, "stages": 3} in q6
    assert not any(s.get("int8_x") is False and (s.get("prefetch") or s.get("stages"))
                   for s in sg.essentials("Q4_K", 1, 4096, 14336)[:2])
    default = (True, 4, 32, 1, False, 0)
    assert big._gemv_settings(1, default, "default") == [default, (True, 4, 32, 1, True, 0), (True, 4, 32, 1, False, 2),
                                                         (True, 4, 32, 1, False, 3), (False, 4, 32, 1, False, 0)]
    quick = sf.settings(4096, 1, quick=True)
    assert [(s["prefetch"], s["stages"]) for s in quick] == list(sf.FORMS) and len(sf.settings(4096, 1, False)) > 40
    plain = sf.settings(4096, 1, False, sf.FORMS[:1])  # --plain: every tile, the plain loop alone
    assert {(s["prefetch"], s["stages"]) for s in plain} == {(False, 0)}
    assert len(plain) * len(sf.FORMS) == len(sf.settings(4096, 1, False))


@pytest.mark.skipif(not HAS_TRITON, reason="the sweeps' checks run on torch tensors")
def test_the_sweeps_checks_pass_the_forms(monkeypatch):
    """sweep_gemv's and sweep_fp8_gemv's own checks pass a prefetch / stages setting (the DSL's interpreter)."""
    import torch

    from tools import sweep_fp8_gemv as sf
    from tools import sweep_gemv as sg
    from tools.kernel_case_base import Dev
    from tools.kernel_cases_fp8 import fp8_weights as dev_fp8_weights

    monkeypatch.setattr(sg, "DEVICE", "cpu")
    monkeypatch.setattr(sg, "TARGET", "numpy")
    monkeypatch.setattr(dgi, "I8_TARGETS", ("numpy",))
    rule = dg.rule_tiles("Q4_K", 1, 8)
    assert sg._check_one("Q4_K", 1, rule | {"prefetch": True}, 8, 512) is None
    monkeypatch.setattr(sf, "TARGET", "numpy")
    d = Dev(3, "cpu")
    x = d.randn((1, 64), torch.bfloat16)
    assert sf.check(torch, d, x, *dev_fp8_weights(d, 8, 64, 16), dict(rows=2, block_k=32, num_warps=1,
                                                                       prefetch=True, stages=0)) is None


def _build(fn, sig, num_warps, **consts):
    from kernels_src.dsl.triton_target import aot_compile

    kern = dsl_launch.compile(fn, "triton", **consts)
    kir = kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig})
    return aot_compile(kir, arch=90, num_warps=num_warps, num_stages=3, aligned=True)


def _cp_async_after_wait(ptx: str) -> bool:
    return 0 <= ptx.find("griddepcontrol.wait") < ptx.find("cp.async")


@needs_aot
def test_aot_sm90_forms(tmp_path, monkeypatch):
    """Q4_K's int8 GEMV at the rule's tiles, int4's at 28672 x 4096, fp8's at its default: stages 3, cp.async only
    after the PDL wait (the pipeliner hoists x's first loads above the loop); Q4_K's prefetch, plain loads; none
    spills."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src import int_group_gemv_i8 as igi

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    t = dg.rule_tiles("Q4_K", 1, 14336)
    it = ig.default_tiles(1, 28672)
    ft = fg.default_tiles(4096, 1)
    kernels = [(dgi.dequant_gemv_i8_kernel, dict(w="*u8", xq="*i8", xd="*fp32", y="*bf16"), t["num_warps"],
                dict(QTYPE="Q4_K", M=1, ROWS=t["ROWS"], STEP=t["STEP"], PDL=True)),
               (igi.int_group_gemv_i8_kernel, dict(w="*i32", xq="*i8", xd="*fp32", xs="*fp32", xr="*fp32", y="*bf16"),
                it["num_warps"], dict(BITS=4, GROUP=128, M=1, ROWS=it["ROWS"], LANES=it["LANES"], VEC=4, PDL=True)),
               (fg.fp8_gemv_kernel, dict(codes="*u8", scales="*fp32", x="*bf16", y="*bf16"), ft["num_warps"],
                dict(GROUP=128, M=1, ROWS=ft["ROWS"], BLOCK_K=ft["BLOCK_K"], EVEN_K=True, PDL=True))]
    for i, (fn, sig, nw, consts) in enumerate(kernels):  # the plain builds: tests of each kernel's own file
        for form in (dict(STAGES=3), dict(PREFETCH=True)) if i == 0 else (dict(STAGES=3),):
            ck = _build(fn, sig, nw, **consts, **form)
            ptx = ck.asm["ptx"]
            what = f"{fn.__name__} {form}"
            assert _stack_bytes(ck.asm["cubin"], tmp_path) == 0, what
            assert bool(re.search(r"cp\.async", ptx)) == ("STAGES" in form), what
            assert "STAGES" not in form or _cp_async_after_wait(ptx), what


def test_programs_an_sm():
    """tools/gemv_loop_builds' occupancy: registers in 256s a warp (64 a thread: 32 one-warp programs; 124: 16),
    shared memory with the 1 KiB kept per program (6,912 bytes: 29), at most 32 programs."""
    from tools.gemv_loop_builds import cases, programs_an_sm

    assert [programs_an_sm(64, 0, 1), programs_an_sm(124, 0, 1), programs_an_sm(64, 6912, 1)] == [32, 16, 29]
    assert programs_an_sm(31, 16, 4) == 16 and programs_an_sm(255, 0, 1) == 8  # 4 warps: 64 warps an SM
    assert len({name for name, *_ in cases()}) == len(cases()) >= 8
