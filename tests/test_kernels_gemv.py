"""Dequantizing GEMV over raw GGUF blocks (all ten quantized types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) on
random valid blocks: the DSL interpreter and Triton's interpreter against x @ dequantize(W).T with our numpy
dequantizer and with gguf-py's (both quant decodings, bf16 activations, rows and blocks off the tiles, unaligned
rows), Triton AOT builds for sm_90 without spills; then the kernel registry and tools/dump_kernel over every
registered kernel."""

from __future__ import annotations

import os
import re
import subprocess
import zlib

import numpy as np
import pytest
from test_gguf_quants import random_raw
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from ir.formats.gguf_quants import QTYPES as GGUF_TYPES
from ir.formats.gguf_quants import row_bytes
from kernels_src import dequant_gemv as dg
from kernels_src import dequant_gemv_i8 as dgi
from kernels_src.dsl import compile, tl
from kernels_src.registry import REGISTRY

TOL = {np.float32: 1e-5, np.float16: 2e-3}  # of the largest output: sums of thousands of terms ~50 in size
# Formats added after the first five run the larger cases on the DSL interpreter only: on Triton's a case costs
# ~10 s, and both interpreters run the same traced program (CI's suite has a time budget).
LIGHT = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K")
needs_aot = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="AOT builds need triton, and TRITON_INTERPRET unset")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # stable across runs


def padded_weights(rng, qtype: str, n: int, k: int, pad: int = 16) -> np.ndarray:
    """Random valid blocks [n, row_bytes], as a view into a buffer whose padding bytes (past each row, up to a
    16-byte boundary and `pad` more, and two rows past the last) are 0xFF: read, they decode to NaN scales or wrong
    values. A `pad` that is not a multiple of 16 leaves rows unaligned."""
    rb = row_bytes(qtype, k)
    big = np.full((n + 2, -(-rb // 16) * 16 + pad), 0xFF, np.uint8)
    big[:n, :rb] = random_raw(qtype, (n, k), rng, 0.05).reshape(n, rb)
    return big[:n, :rb]


def close(got, want, dtype=np.float32):
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(want).max())


def k_for(qtype: str, blocks: int) -> int:
    return blocks * GGUF_TYPES[qtype].block_size


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("qtype", dg.QTYPES)
@pytest.mark.parametrize("m,n,blocks", [(1, 5, 3), (3, 9, 18)])  # rows and chunks off the tiles
def test_dequant_gemv(target, dtype, qtype, m, n, blocks, rng):
    if qtype in LIGHT and target != "numpy" and m > 1:
        pytest.skip("Triton's interpreter runs this format's small case only (LIGHT)")
    k = k_for(qtype, blocks if qtype.endswith("K") else 5 * blocks)
    w = padded_weights(rng, qtype, n, k)
    x = rng.standard_normal((m, k)).astype(dtype)
    out = dev(np.full((m, n), np.nan, dtype), target)
    dg.dequant_gemv(dev(x, target), dev(w, target), qtype, out=out, target=target)
    got = host(out).astype(np.float32)
    assert np.isfinite(got).all()
    close(got, dg.dequant_gemv_ref(x, w, qtype), dtype)


@pytest.mark.parametrize("qtype", LIGHT)  # the first five: through our dequantizer, itself checked against gguf-py's
def test_dequant_gemv_matches_gguf(qtype, rng):
    """Against W decoded by gguf-py's dequantizer, independent of ours (the DSL interpreter: Triton's runs the same
    program against our dequantizer above)."""
    target = "numpy"
    from test_gguf_quants import gguf_ref

    k = k_for(qtype, 2 if qtype.endswith("K") else 6)
    w = padded_weights(rng, qtype, 4, k)
    x = rng.standard_normal((2, k)).astype(np.float32)
    out = dev(np.full((2, 4), np.nan, np.float32), target)
    dg.dequant_gemv(dev(x, target), dev(w, target), qtype, out=out, target=target)
    close(host(out), x @ gguf_ref(np.ascontiguousarray(w), qtype, (4, k)).T)


@pytest.mark.parametrize("qtype", dg.QTYPES)
def test_dequant_gemv_vector_and_tiles(qtype, rng):
    """A 1-d x; a batch of 8; a loop step per block with one part a lane; 3 rows a program (not a power of two)."""
    k = k_for(qtype, 2 if qtype.endswith("K") else 7)
    w = padded_weights(rng, qtype, 5, k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    y = dg.dequant_gemv(x[0], w, qtype)
    assert y.shape == (5,)
    close(y, dg.dequant_gemv_ref(x[:1], w, qtype)[0])
    close(dg.dequant_gemv(x, w, qtype), dg.dequant_gemv_ref(x, w, qtype))
    close(dg.dequant_gemv(x[:2], w, qtype, rows=3, step=1, parts=1), dg.dequant_gemv_ref(x[:2], w, qtype))
    with pytest.raises(ValueError, match="M <= 8"):
        dg.dequant_gemv(np.zeros((9, k), np.float32), w, qtype)


@pytest.mark.parametrize("qtype", dg.QTYPES)
def test_dequant_gemv_unaligned(qtype, rng, monkeypatch):
    """Rows 2 bytes off a 4-byte boundary (Q4_K's are copied to aligned rows), x rows at an odd stride; and the
    decoding the SIMT targets use (no subnormals) through the DSL interpreter."""
    k = k_for(qtype, 3 if qtype.endswith("K") else 9)
    w = padded_weights(rng, qtype, 7, k, pad=6)
    x = rng.standard_normal((3, k + 1)).astype(np.float32)[:, :k]
    want = dg.dequant_gemv_ref(x, w, qtype)
    close(dg.dequant_gemv(x, w, qtype), want)
    monkeypatch.setattr(dg, "SUBNORMAL_TARGETS", ())
    close(dg.dequant_gemv(x, w, qtype), want)


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 activations need torch")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", dg.QTYPES)
def test_dequant_gemv_bf16(target, qtype, rng):
    """bf16 x and y: x is read as 32- and 64-bit words of bf16 pairs and quads (the same reads for every format of
    a family: of the LIGHT ones, Q5_0 and Q5_K run on Triton's interpreter)."""
    if qtype in LIGHT and qtype not in ("Q5_0", "Q5_K") and target != "numpy":
        pytest.skip("LIGHT format: its family's bf16 reads run for Q5_0 / Q5_K")
    import torch

    k = k_for(qtype, 2 if qtype.endswith("K") else 6)
    w = padded_weights(rng, qtype, 6, k)
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32)).bfloat16()
    out = torch.full((2, 6), float("nan"), dtype=torch.bfloat16)
    dg.dequant_gemv(x, dev(w, target), qtype, out=out, target=target)  # both interpreters take CPU torch tensors
    want = dg.dequant_gemv_ref(x.float().numpy(), w, qtype)
    np.testing.assert_allclose(out.float().numpy(), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


# --- int8 activations (Q4_K): tl.dot4, quantize_x, the int8 GEMV -------------------------------------------------
# The int8 GEMV computes W @ xq with xq = q * d, x quantized per 32 elements. It is checked (1) against the fp32
# reference on the xq it was given (quantize_x's own output), at the fp path's tolerance: only its arithmetic is
# tested there; (2) quantize_x against quantize_x_ref, q within 1 (a tie may round either way after the target's
# fp32 rounding of 127 / max|x|); (3) y against the exact x @ W.T within int8_error_bound, the worst case of rounding
# each x to the nearest step d / 2 away, plus the output's own rounding.

I8_TARGETS = TARGETS + ["simt-cpu"]


def dot4_kernel(a, b, c, out, N: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr):
    tl.launch_dependents()
    i = tl.arange(0, N)
    tl.wait_prior_grid()
    tl.store(out + i, tl.dot4(tl.load(a + i), tl.load(b + i), tl.load(c + i), signed_a=SA, signed_b=SB))


@pytest.mark.parametrize("target", I8_TARGETS)
def test_dot4_op(target, rng):
    a, b = (rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    a[:4], b[:4] = 0xFFFFFFFF, 0x80808080  # the byte extremes
    c = rng.integers(-2**30, 2**30, 64).astype(np.int32)
    for sa in (False, True):
        for sb in (False, True):
            ab, bb = (v.view(np.int8 if s else np.uint8).reshape(-1, 4).astype(np.int64) for v, s in ((a, sa), (b, sb)))
            want = (c + (ab * bb).sum(1)).astype(np.uint32).view(np.int32)  # wraps in 32 bits
            out = dev(np.zeros(64, np.int32), target)
            compile(dot4_kernel, target, N=64, SA=sa, SB=sb)[1](dev(a, target), dev(b, target), dev(c, target), out)
            np.testing.assert_array_equal(host(out), want)


def test_dot4_triton_source():
    from kernels_src.dsl.triton_target import TritonRenderer

    k = compile(dot4_kernel, "numpy", N=64, SA=False, SB=True).trace(
        signature=dict(a="*u32", b="*u32", c="*i32", out="*i32"))
    src = TritonRenderer().render(k)
    assert "dp4a.u32.s32" in src and "tlc.gdc_wait()" in src and "tlc.gdc_launch_dependents()" in src
    src = TritonRenderer(interpret=True).render(k)  # Triton's interpreter runs no inline assembly
    assert "dp4a" not in src and "gdc" not in src
    with pytest.raises(Exception, match="32-bit integer words"):
        compile(lambda a, N: tl.dot4(tl.load(a), 1, 0), "numpy").trace(signature=dict(a="*u16", N="i32"))


def _x_for(target, x):
    if x.dtype == np.float16 and target != "numpy" and HAS_TRITON:  # bf16 through torch where a target takes it
        import torch

        return torch.from_numpy(x.astype(np.float32)).bfloat16() if target.startswith("triton") else dev(x, target)
    return dev(x, target)


def _xh(x):
    return x.float().numpy() if hasattr(x, "float") else np.asarray(x, np.float32)


@pytest.mark.parametrize("target", I8_TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_x(target, dtype, rng):
    x = (rng.standard_normal((3, 512)) * rng.uniform(0.1, 30, (3, 16)).repeat(32, 1)).astype(dtype)
    x[1, :32] = 0  # an all-zero block: d = 0, q = 0
    xt = _x_for(target, x)
    q, d = (host(a) for a in dgi.quantize_x(xt, target=target))
    q_ref, d_ref = dgi.quantize_x_ref(_xh(xt))
    np.testing.assert_allclose(d, d_ref, rtol=1e-6)
    assert np.abs(q.astype(np.int32) - q_ref).max() <= 1 and np.abs(q).max() <= 127
    assert (q[1, :32] == 0).all() and d[1, 0] == 0


@pytest.mark.parametrize("target", I8_TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m,n,blocks", [(1, 5, 3), (3, 9, 2)])
@pytest.mark.parametrize("qtype", dgi.I8_QTYPES)
def test_dequant_gemv_int8(target, dtype, m, n, blocks, qtype, rng):
    if qtype != "Q4_K" and target != "numpy" and m > 1:
        pytest.skip("the other formats' larger case on the DSL interpreter only (the same traced program)")
    k = k_for(qtype, blocks)
    w = padded_weights(rng, qtype, n, k, pad=6 if qtype == "Q6_K" else 16)  # Q6_K's rows need 2-byte alignment
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, k // 32)).repeat(32, 1)).astype(dtype)
    xt = _x_for(target, x)
    out = dev(np.full((m, n), np.nan, dtype), target) if not hasattr(xt, "bfloat16") else \
        __import__("torch").full((m, n), float("nan"), dtype=xt.dtype)
    dg.dequant_gemv(xt, dev(w, target), qtype, out=out, target=target, int8_x=True)
    got = host(out.float() if hasattr(out, "float") else out).astype(np.float32)
    assert np.isfinite(got).all()
    xh = _xh(xt)
    q, d = (host(a) for a in dgi.quantize_x(xt, target=target))
    want_q = dg.dequant_gemv_ref(dgi.dequantize_x(q, d), w, qtype)
    if hasattr(out, "bfloat16"):  # bf16 y: within an ulp (Triton's interpreter may truncate)
        np.testing.assert_allclose(got, want_q, rtol=2.0 ** -7, atol=TOL[np.float16] * np.abs(want_q).max())
    else:
        close(got, want_q, np.float32 if dtype == np.float32 else np.float16)
    want = dg.dequant_gemv_ref(xh, w, qtype)
    eps = 2.0 ** -23 if dtype == np.float32 else 2.0 ** -7  # the output's rounding (bf16 or fp16 y)
    bound = dgi.int8_error_bound(xh, w, qtype) + eps * np.abs(want) + TOL[np.float32] * np.abs(want).max()
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() > 1e-4 * np.abs(want).max()  # int8 x really was used


def test_dequant_gemv_int8_defaults(rng):
    assert dgi.uses_int8("q4_k", "triton") and dgi.uses_int8("Q6_K", "triton") and not dgi.uses_int8("Q4_K", "numpy")
    assert not dgi.uses_int8("Q8_0", "triton")
    with pytest.raises(ValueError, match="int8-activation"):
        dg.dequant_gemv(np.zeros((1, 256), np.float32), padded_weights(rng, "Q8_0", 2, 256), "Q8_0", int8_x=True)


@needs_aot
def test_aot_sm90_int8(tmp_path, monkeypatch):
    """The int8 GEMV builds for sm_90 with dp4a and a grid-dependency wait, spilling nothing."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for k in dgi.traces():
        jit = JITFunction(load_function(TritonRenderer().render(k), k.name))
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(k.params))}
        c = triton.compile(ASTSource(jit, signature=k.signature, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 1})
        ptx = c.asm["ptx"]
        assert ("dp4a.u32.s32" in ptx and "griddepcontrol.wait" in ptx) if k.name != "quantize_x_kernel" else \
            "griddepcontrol.launch_dependents" in ptx
        assert _stack_bytes(c.asm["cubin"], tmp_path) == 0


def test_default_tiles_fill_a_warp():
    for qtype in dg.QTYPES:
        for m in range(1, 9):
            t = dg.rule_tiles(qtype, m, 14336)
            assert t["STEP"] * dg.LANES[qtype] // t["PARTS"] == 32 * t["num_warps"]
            assert m * t["ROWS"] <= 4 or t["ROWS"] == 1 or (m > 4 and t["ROWS"] == 2)  # measured: sweep_gemv


def _stack_bytes(cubin: bytes, tmp_path) -> int:
    """Local memory (spills) per thread of a cubin, read with the cuobjdump that ships with triton."""
    import triton

    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@needs_aot
@pytest.mark.parametrize("qtype", dg.QTYPES)
@pytest.mark.parametrize("m", [1, 8])
def test_aot_sm90(qtype, m, tmp_path, monkeypatch):
    """The default tiles build for sm_90 with the 16-byte alignment the JIT specializes on, and spill nothing (the
    plain AOT build of every GEMV: test_kernels_pdl.py's test_aot_sm90). At M = 8 (the most registers) LIGHT
    formats but Q5_K build only with GEMV_AOT_ALL=1 (~10 s a build; all passed, no spills, when they were added)."""
    if m == 8 and qtype in LIGHT and qtype != "Q5_K" and not os.environ.get("GEMV_AOT_ALL"):
        pytest.skip("LIGHT format at M = 8: set GEMV_AOT_ALL=1 to build it")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, load_function

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry = REGISTRY[f"dequant_gemv_{qtype.lower()}"]
    tiles = dg.default_tiles(qtype, m, 14336, 4096)
    nw = tiles.pop("num_warps")
    x_type = "*fp16" if m > 1 else "*bf16"
    k = entry.trace(signature=dict(x=x_type, y=x_type), M=m, **tiles)
    fn = JITFunction(load_function(TritonRenderer().render(k), k.name))
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(k.params))}
    compiled = triton.compile(ASTSource(fn, signature=k.signature, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": nw})
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert "ld.global.v4" in compiled.asm["ptx"]  # 16-byte loads of x (and of Q4_K's and Q5_K's quants)
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0


# --- the registry and tools/dump_kernel --------------------------------------------------------------------------

def test_registry_covers_every_kernel():
    """Every `*_kernel` of every module in kernels_src/ (found on disk: a new file is covered too) is registered."""
    import importlib
    import pkgutil

    import kernels_src

    modules = [importlib.import_module(f"kernels_src.{m.name}") for m in pkgutil.iter_modules(kernels_src.__path__)
               if not m.ispkg]
    kernels = {f for mod in modules for name, f in vars(mod).items()
               if name.endswith("_kernel") and callable(f) and f.__module__ == mod.__name__}
    assert kernels == {e.fn for e in REGISTRY.values()} | {v for e in REGISTRY.values() for v in e.variants}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registry_entry(name):
    from kernels_src.dsl.triton_target import TritonRenderer

    e = REGISTRY[name]
    k = e.trace()
    assert k.signature == e.signature and set(k.constexprs) == set(e.constexprs)
    assert f"def {e.fn.__name__}(" in TritonRenderer().render(k)
    assert e.bytes_moved(**e.bench) > 0 and (e.flops is None or e.flops(**e.bench) > 0)


def test_dump_kernel_tool(capsys):
    from tools.dump_kernel import main

    assert main(["paged_decode", "--const", "BLOCK_N=32", "--sig", "q=*fp16"]) == 0
    out = capsys.readouterr().out
    assert "# ---- ir: paged_decode ----" in out and "# ---- triton: paged_decode ----" in out
    assert "BLOCK_N=32" in out and "%q: *fp16" in out and "def paged_decode_kernel(" in out
    assert main(["silu_mul", "--target", "triton", "--const", "ACT=gelu"]) == 0
    assert "tl.erf(" in capsys.readouterr().out
    assert main(["--list"]) == 0 and "dequant_gemv_q6_k" in capsys.readouterr().out
    assert main(["no_such_kernel"]) == 2
    assert main(["rms_norm", "--const", "NOPE=1"]) == 2


def test_every_registry_kernel_has_a_quick_problem():
    """bench_kernels --quick shrinks each problem; every kernel must have its smaller twin of the same shape."""
    from tools.kernel_case_base import quick_params

    for name, entry in REGISTRY.items():
        assert quick_params(name, entry.bench) != entry.bench, name  # (a kernel without one raises KeyError)
