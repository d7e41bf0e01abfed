"""Programmatic dependent launch (PDL) in the per-layer kernels, without a GPU: where each kernel waits in its IR
(before every store and every load an earlier kernel may have written), that the launchers pass `pdl` through,
that a PDL launch computes bit for bit what a plain one does (on both interpreters), and AOT builds for sm_90
that hold the griddepcontrol instructions."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from test_gguf_quants import random_raw

from ir.formats.gguf_quants import QTYPES as GGUF_TYPES
from kernels_src import (
    activations,
    dense_gemv,
    dequant_gemv,
    dequantize,
    fp8_gemv,
    int_group_gemv,
    kv_write,
    paged_attention,
    paged_prefill,
    rms_norm,
    rope,
)
from kernels_src.dsl import KernelIR, format_kernel, tl
from kernels_src.dsl import launch as dsl_launch
from kernels_src.dsl.ir import GRID_DEP
from kernels_src.dsl.tracer import split_params
from kernels_src.registry import REGISTRY

HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None

# registry name -> pointers a program may load before its wait: weights and tables, which no kernel writes (the
# batch's context lengths are copied in from the host before a step's first kernel)
ALLOWED = {
    "rms_norm": {"w"}, "add_rms_norm": {"w"}, "silu_mul": set(), "rope": {"cos", "sin"}, "kv_write": set(),
    "paged_decode": {"context_lens"}, "paged_decode_reduce": {"context_lens"}, "paged_prefill": set(),
    "moe_route": {"bias"},
    **{f"dequant_gemv_{q.lower()}": {"w"} for q in dequant_gemv.QTYPES},
    **{f"dequantize_{q.lower()}": {"w"} for q in dequantize.QTYPES},
    **{name: {"w", "g"} for name in REGISTRY if name.startswith("dense_gemv")},  # the weights and the norm's
    "fp8_gemv": {"codes", "scales"}, "int_group_gemv": {"w"},
}
# The GEMVs wait inside their loop over K, after each step's weight loads (and once more before the stores).
LOOP_WAIT = {name for name in ALLOWED if name.startswith(("dequant_gemv_", "dense_gemv", "fp8_gemv", "int_group_gemv"))}
PDL_ENTRIES = sorted(name for name, e in REGISTRY.items() if "PDL" in split_params(e.fn)[1])


def _roots(v) -> set:
    """Names of the kernel parameters a pointer value is computed from."""
    if v.op is None:
        return {v.name}
    return set().union(*(_roots(a) for a in v.op.args if a.type.is_ptr))


def check_pdl(k: KernelIR, allowed: set, loop_wait: bool = False) -> None:
    """The convention of dsl.use_pdl: a wait in the kernel's top block, so every program waits whatever its loops
    run; every store and every load of a pointer outside `allowed` after a wait of its own block or of one around
    it; launch_dependents in the top block, after a wait. `loop_wait`: waits inside loops are allowed too."""
    def walk(block, waited: bool, top: bool) -> None:
        for op in block.ops:
            if op.opcode == "grid_dep_wait":
                assert top or loop_wait, f"{k.name}: a wait inside a loop"
                waited = True
            elif op.opcode == "grid_dep_launch":
                assert top and waited, f"{k.name}: launch_dependents inside a loop or before the wait"
            elif op.opcode == "store":
                assert waited, f"{k.name}: a store before the wait"
            elif op.opcode == "load" and not waited:
                assert _roots(op.args[0]) <= allowed, f"{k.name}: loads {_roots(op.args[0])} before the wait"
            if op.body is not None:
                walk(op.body, waited, False)

    walk(k.body, False, True)
    top = [op.opcode for op in k.body.ops]
    assert "grid_dep_wait" in top and "grid_dep_launch" in top, f"{k.name}: no wait and launch in the top block"


def _body(k: KernelIR) -> list[str]:
    return format_kernel(k).splitlines()[1:]  # [1:]: past the header, which lists the constexprs


def _without_grid_dep(k: KernelIR) -> list[str]:
    return [line for line in _body(k) if "grid_dep" not in line]


# --- the IR ------------------------------------------------------------------------------------------------------

def test_the_kernels_take_pdl():
    assert set(ALLOWED) <= set(PDL_ENTRIES)


@pytest.mark.parametrize("name", PDL_ENTRIES)
def test_waits_before_what_earlier_kernels_write(name):
    entry = REGISTRY[name]
    plain, pdl = entry.trace(PDL=False), entry.trace(PDL=True)
    assert not any(op.opcode in GRID_DEP for op in plain.walk())
    default = dsl_launch.compile(entry.fn, **{c: v for c, v in entry.constexprs.items() if c != "PDL"})
    assert _body(default.trace(signature=entry.signature)) == _body(plain)  # PDL is off by default
    assert _without_grid_dep(pdl) == _without_grid_dep(plain)
    check_pdl(pdl, ALLOWED.get(name, set()), name in LOOP_WAIT)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_rope_decode_reads_ahead_only_what_no_kernel_of_the_step_writes(prefetch):
    """paged_decode_rope loads the host's context lengths, slots, rope rows and cos / sin before its wait, and with
    PREFETCH its first key tile too: the block table (the host's) and earlier steps' keys and values (this step's
    key and value are written by this kernel, after the wait, and put into that tile from registers)."""
    from test_kernels_basic import _sig

    from kernels_src import paged_decode_rope as pdr

    consts = {c: v for c, v in REGISTRY["paged_decode"].constexprs.items() if c != "PDL"} | dict(HALF=64,
                                                                                                 INTERLEAVED=False)
    ptrs = dict.fromkeys(("q", "k", "v", "k_cache", "v_cache", "out"), "*bf16") | dict.fromkeys(
        ("block_tables", "context_lens", "slots", "rows"), "*i32") | dict.fromkeys(
        ("cos", "sin", "part_m", "part_l", "part_acc"), "*fp32")
    fn = pdr.paged_decode_rope_kernel
    k = dsl_launch.compile(fn, PDL=True, PREFETCH=prefetch, **consts).trace(
        signature=_sig(fn, ptrs, floats=("scale", "softcap")))
    host = {"context_lens", "slots", "rows", "cos", "sin"}
    check_pdl(k, host | ({"block_tables", "k_cache", "v_cache"} if prefetch else set()))
    if prefetch:  # and not without it
        with pytest.raises(AssertionError, match="before the wait"):
            check_pdl(k, host)


def _bad_kernel(x, w, out, LOOP: tl.constexpr, PDL: tl.constexpr = False):
    """LOOP False: x is loaded before the wait. LOOP True: the only wait is in a loop that may run no step."""
    i = tl.arange(0, 16)
    v = tl.load(w + i)
    if LOOP:
        def body(it, acc):
            if PDL:
                tl.wait_prior_grid()
            return (acc + tl.load(x + i),)

        v = tl.fori_loop(0, 2, body, (v,))[0]
    else:
        v = v + tl.load(x + i)
        if PDL:
            tl.wait_prior_grid()
            tl.launch_dependents()
    tl.store(out + i, v)


@pytest.mark.parametrize("loop,problem", [(False, "loads {'x'} before the wait"), (True, "a store before the wait")])
def test_the_check_refuses_misplaced_waits(loop, problem):
    k = dsl_launch.compile(_bad_kernel, LOOP=loop, PDL=True).trace(signature=dict(x="*fp32", w="*fp32", out="*fp32"))
    with pytest.raises(AssertionError, match=problem):
        check_pdl(k, {"w"}, loop_wait=True)


# --- the launchers: same results with and without PDL --------------------------------------------------------

def _f32(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _nan(*shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def run_rms_norm(t, target, pdl):
    rng = np.random.default_rng(1)
    out = t(_nan(3, 40))
    rms_norm.rms_norm(t(_f32(rng, 3, 40)), t(_f32(rng, 40)), 1e-6, offset=True, out=out, target=target, pdl=pdl)
    return [out]


def run_add_rms_norm(t, target, pdl):
    rng = np.random.default_rng(2)
    x, r = t(_f32(rng, 3, 40)), t(_f32(rng, 3, 40))
    rms_norm.add_rms_norm(x, r, t(_f32(rng, 40)), 1e-5, sum_out=x, out=r, target=target, pdl=pdl)  # in place
    return [x, r]


def run_gated_act(t, target, pdl):
    out = t(_nan(3, 40))
    activations.gated_act_fused(t(_f32(np.random.default_rng(3), 3, 80)), "silu", out=out, block=16, target=target,
                                pdl=pdl)
    return [out]


def run_rope(t, target, pdl):
    rng = np.random.default_rng(4)
    qkv = t(_f32(rng, 3, 8, 16))
    angles = np.arange(8)[:, None] * rng.uniform(0.01, 1.0, 6)[None, :]
    rope.rope(qkv[:, :4], qkv[:, 4:6], t(rng.integers(0, 8, 3).astype(np.int32)), t(np.cos(angles).astype(np.float32)),
              t(np.sin(angles).astype(np.float32)), target=target, pdl=pdl)
    return [qkv]


def run_kv_write(t, target, pdl):
    rng = np.random.default_rng(5)
    slots = rng.permutation(12)[:4].astype(np.int64)
    slots[1] = -1
    kc, vc = t(_nan(3, 4, 2, 8)), t(_nan(3, 4, 2, 8))
    kv_write.kv_write(t(_f32(rng, 4, 2, 8)), t(_f32(rng, 4, 2, 8)), kc, vc, t(slots), target=target, pdl=pdl)
    return [kc, vc]


def _cache(rng, t, ctx, bs=4):
    n = len(ctx) * -(-max(ctx) // bs)
    tables = rng.permutation(n + 2)[:n].reshape(len(ctx), -1).astype(np.int32)  # shuffled, two blocks unused
    shape = (n + 2, bs, 2, 16)
    return t(_f32(rng, *shape)), t(_f32(rng, *shape)), t(tables), t(np.array(ctx, np.int32))


def run_paged_decode(t, target, pdl, partition=16, fused=False):
    rng = np.random.default_rng(6)
    kc, vc, tables, ctx = _cache(rng, t, [9, 37])
    out = t(_nan(2, 4, 16))
    paged_attention.paged_decode(t(_f32(rng, 2, 4, 16)), kc, vc, tables, ctx, 0.3, out=out, partition=partition,
                                 block_n=16, target=target, pdl=pdl, fused=fused)
    return [out]


def run_paged_prefill(t, target, pdl):
    rng = np.random.default_rng(7)
    kc, vc, tables, ctx = _cache(rng, t, [6, 8])
    out = t(_nan(8, 4, 16))
    paged_prefill.paged_prefill(t(_f32(rng, 8, 4, 16)), kc, vc, tables, ctx, t(np.array([0, 3, 8], np.int32)), 0.3,
                                out=out, block_m=16, block_n=16, target=target, pdl=pdl)
    return [out]


def _blocks(rng, qtype, n=5):
    k = GGUF_TYPES[qtype].block_size * (2 if qtype.endswith("K") else 7)
    return random_raw(qtype, (n, k), rng, 0.05).reshape(n, -1), k


def run_dequantize(t, target, pdl, qtype="Q4_K"):
    rng = np.random.default_rng(8)
    w, k = _blocks(rng, qtype)
    out = t(_nan(4, k))
    dequantize.dequantize_rows(t(w), t(np.array([3, 0, 4, 3], np.int32)), qtype, k, out=out, target=target, pdl=pdl)
    return [out]


def run_dequant_gemv(t, target, pdl, qtype="Q4_K"):
    rng = np.random.default_rng(9)
    w, k = _blocks(rng, qtype)
    out = t(_nan(2, 5))
    dequant_gemv.dequant_gemv(t(_f32(rng, 2, k)), t(w), qtype, out=out, target=target, int8_x=False, pdl=pdl)
    return [out]


def run_dense_gemv(t, target, pdl, prologue="none"):
    """Each prologue on 3 rows, K over several steps (64 a step) and off them; the residual epilogue with none."""
    rng = np.random.default_rng(10)
    k = 150
    x, w, out = t(_f32(rng, 3, 2 * k if prologue == "gated" else k)), t(_f32(rng, 5, k)), t(_nan(3, 5))
    pro = {"none": None, "rms_norm": dense_gemv.RMSNorm(t(_f32(rng, k)), 1e-5, True),
           "add_rms_norm": dense_gemv.AddRMSNorm(t(_f32(rng, 3, k)), t(_f32(rng, k)), 1e-5, sum_out=t(_nan(3, k))),
           "gated": dense_gemv.Gated("silu")}[prologue]
    dense_gemv.dense_gemv(x, w, prologue=pro, residual=t(_f32(rng, 3, 5)) if pro is None else None, out=out,
                          block_k=64, target=target, pdl=pdl)
    return [out] + ([pro.sum_out] if prologue == "add_rms_norm" else [])


def run_fp8_gemv(t, target, pdl):
    """3 rows, K over several steps (64 a step) in groups of 32."""
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 0x7F, (5, 160)).astype(np.uint8)  # finite codes, both signs below
    codes |= rng.integers(0, 2, codes.shape).astype(np.uint8) << 7
    out = t(_nan(3, 5))
    fp8_gemv.fp8_gemv(t(_f32(rng, 3, 160)), t(codes), t(np.abs(_f32(rng, 5, 5))), out=out, block_k=64,
                      target=target, pdl=pdl)
    return [out]


def run_int_group_gemv(t, target, pdl):
    """3 rows over several steps (4 vectors a step) of 4-bit groups of 32."""
    from ir.formats import int_groups

    rng = np.random.default_rng(12)
    q, zeros = rng.integers(0, 16, (5, 256)), rng.integers(0, 16, (5, 8))
    w = int_groups.pack(q, rng.uniform(0.01, 0.02, (5, 8)).astype(np.float32), zeros, 4, 32)
    out = t(_nan(3, 5))
    int_group_gemv.int_group_gemv(t(_f32(rng, 3, 256)), t(w), 4, 32, out=out, lanes=4, target=target, pdl=pdl,
                                  int8_x=False)
    return [out]


RUNS = {
    "rms_norm": run_rms_norm, "add_rms_norm": run_add_rms_norm, "gated_act": run_gated_act, "rope": run_rope,
    "kv_write": run_kv_write, "paged_decode_split": run_paged_decode,
    "paged_decode_fused": lambda t, target, pdl: run_paged_decode(t, target, pdl, fused=True),
    "paged_decode_single": lambda t, target, pdl: run_paged_decode(t, target, pdl, partition=512),
    "paged_prefill": run_paged_prefill,
    **{f"dequantize_{q}": lambda t, target, pdl, q=q: run_dequantize(t, target, pdl, q) for q in dequantize.QTYPES},
    # PDL waits in the format-independent loop: of the formats added after the first five, Q5_K alone is run
    **{f"dequant_gemv_{q}": lambda t, target, pdl, q=q: run_dequant_gemv(t, target, pdl, q)
       for q in dequant_gemv.QTYPES if q not in ("Q5_0", "Q5_1", "Q2_K", "Q3_K")},
    **{f"dense_gemv_{p}": lambda t, target, pdl, p=p: run_dense_gemv(t, target, pdl, p) for p in dense_gemv.PROLOGUES},
    "fp8_gemv": run_fp8_gemv, "int_group_gemv": run_int_group_gemv,
}
LAUNCHERS = (activations, dense_gemv, dequant_gemv, dequantize, fp8_gemv, int_group_gemv, kv_write, paged_attention,
             paged_prefill, rms_norm, rope)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args: None

    bind = __getitem__  # a launcher's plan of fixed shapes (dsl.launch.BoundLaunch)


class Compiles:
    """The launchers' compile calls as (kernel, target, launch_pdl, PDL); with `launch` False none runs."""

    def __init__(self):
        self.calls, self.launch = [], True

    def wrap(self, real):
        def compile(fn, target="numpy", **kw):  # noqa: A001
            self.calls.append((fn.__name__, target, kw.get("launch_pdl", False), kw.get("PDL", False)))
            return real(fn, target, **kw) if self.launch else _NoLaunch()
        return compile


@pytest.fixture
def compiles(monkeypatch):
    spy = Compiles()
    for module in LAUNCHERS:
        monkeypatch.setattr(module, "compile", spy.wrap(module.compile))
    return spy


@pytest.mark.parametrize("case", list(RUNS))
def test_pdl_by_default_on_triton_only(case, compiles):
    compiles.launch = False  # target "triton" needs a GPU: record the compiles, launch nothing
    # pdl=True asks for PDL only where the target has it (dsl.PDL_TARGETS)
    for target, pdl in (("triton", None), ("numpy", None), ("triton", False), ("numpy", True)):
        RUNS[case](lambda a: a, target, pdl)
    n = len(compiles.calls) // 4
    assert n >= 1 and len(compiles.calls) == 4 * n
    assert [c[2:] for c in compiles.calls] == [(True, True)] * n + [(False, False)] * 3 * n


@pytest.mark.parametrize("target", ["numpy", pytest.param("triton-interpret", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton/torch not installed"))])
@pytest.mark.parametrize("case", list(RUNS))
def test_same_results_with_pdl(case, target, compiles, monkeypatch):
    """The launchers' PDL path end to end (constexprs, launch options, the traced PDL kernels) on the interpreters,
    where the waits are no-ops; fp32 (Triton's interpreter mishandles bf16)."""
    monkeypatch.setattr(dsl_launch, "PDL_TARGETS", ("triton", target))
    if target == "numpy":
        t, host = (lambda a: a), (lambda a: a)
    else:
        import torch

        t, host = torch.from_numpy, (lambda a: a.numpy())
    plain = [host(o) for o in RUNS[case](t, target, False)]
    pdl = [host(o) for o in RUNS[case](t, target, True)]
    n = len(compiles.calls) // 2
    assert [c[2:] for c in compiles.calls] == [(False, False)] * n + [(True, True)] * n
    for a, b in zip(plain, pdl, strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.isfinite(b).any()


# --- ahead-of-time builds for sm_90 ------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", PDL_ENTRIES)
def test_aot_sm90(name, tmp_path, monkeypatch):
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real build through ptxas, not a cache hit
    warps = 1 if name.startswith("dequant_gemv_") else 4  # as their launchers run them
    ptx = aot_compile(REGISTRY[name].trace(PDL=True), arch=90, num_warps=warps).asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "griddepcontrol.launch_dependents" in ptx
    assert -1 < ptx.find("griddepcontrol.wait") < ptx.find("st.global")
