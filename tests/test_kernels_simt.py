"""The SIMT lowering and its C-like emitters, with no GPU: every kernel of kernels_src runs through the CPU oracle
(the SIMT form rendered as C++ by the same renderer as Metal and CUDA C, compiled here, every thread a fiber,
threadgroup memory race-checked) against the numpy references, on poisoned outputs and shapes off the tiles; the
Metal source as MLX wraps it and the CUDA C parse with libclang; planted mistakes are caught. On a CUDA machine
with CuPy the same numerical cases run the CUDA C twin (target "cuda")."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from test_kernels_attention import DECODE_CASES, PREFILL_CASES, paged_cache
from test_kernels_dsl import _int_inputs, decode_sketch_kernel, float_kernel, int_kernel
from test_kernels_gemv import k_for, padded_weights

from kernels_src import activations, dequant_gemm, gguf_mmq, kv_write, rms_norm, rope, rope_kv_write
from kernels_src import dequant_gemv as dg
from kernels_src import dequantize as dq
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import simt, trace
from kernels_src.dsl.cpu_target import CpuKernel, CpuRenderer, SimtError
from kernels_src.dsl.ir import PtrType
from kernels_src.registry import REGISTRY


def _has_cuda() -> bool:
    if importlib.util.find_spec("cupy") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_CLANG = importlib.util.find_spec("clang") is not None
TARGETS = ["simt-cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _has_cuda(), reason="no CUDA + CuPy"))]
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float16: dict(rtol=3e-3, atol=3e-3)}
needs_clang = pytest.mark.skipif(not HAS_CLANG, reason="libclang not installed (pip install libclang)")
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx not installed")


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
           gguf_mmq.mmq_q4k_kernel, gguf_mmq.mmq_q6k_kernel}  # their simt-cpu case: test_kernels_mmq.py


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


# --- parse checks: Metal as MLX wraps it, CUDA C --------------------------------------------------------------

class _Arr:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


_NP = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "i32": "int32", "i64": "int64", "u8": "uint8",
       "i8": "int8"}


def _metal_wrapped(k, n: int) -> str:
    from kernels_src.dsl.metal_target import MetalRenderer, default_outputs, wrap_like_mlx

    s, r = simt.lower(k), MetalRenderer()
    args = [_Arr((n,), _NP[p.dtype.elem.name]) if isinstance(p.dtype, PtrType) else 1 for p in k.params]
    return wrap_like_mlx(s, r.render(s), r.header(), default_outputs(s), *args)


# GEMV formats added after the first five share the kernel body and emitters with them; of those, only Q5_K's source
# (~10 s of libclang each) is parse-checked here (the GPU tests compile them all with CuPy).
PARSE_SKIP = {f"dequant_gemv_{q.lower()}" for q in ("Q5_0", "Q5_1", "Q2_K", "Q3_K")}


@needs_clang
@pytest.mark.parametrize("name", [n for n in REGISTRY if n not in PARSE_SKIP])
def test_parse_metal_and_cuda(name):
    from kernels_src.dsl.cuda_target import CudaRenderer
    from kernels_src.dsl.parse_check import check_cuda, check_metal

    k = REGISTRY[name].trace()
    for n in (4096, 4):  # inputs in `device` memory, and in `constant` memory (MLX: fewer than 8 elements)
        problems = check_metal(_metal_wrapped(k, n))
        assert not problems, "\n".join(map(str, problems))
    problems = check_cuda(CudaRenderer().render(simt.lower(k)))
    assert not problems, "\n".join(map(str, problems))


@needs_clang
def test_parse_metal_and_cuda_int8_gemv():
    """The int8-activation Q4_K path (a registry variant, not an entry of its own): its MSL and CUDA C parse too."""
    from kernels_src.dequant_gemv_i8 import traces
    from kernels_src.dsl.cuda_target import CudaRenderer
    from kernels_src.dsl.parse_check import check_cuda, check_metal

    for k in traces("fp16"):
        problems = check_metal(_metal_wrapped(k, 4096)) + check_cuda(CudaRenderer().render(simt.lower(k)))
        assert not problems, "\n".join(map(str, problems))


@needs_clang
def test_parse_checks_catch_mistakes():
    from kernels_src.dsl.cuda_target import CudaRenderer
    from kernels_src.dsl.parse_check import check_cuda, check_metal

    k = REGISTRY["rms_norm"].trace()
    metal, cuda = _metal_wrapped(k, 4096), CudaRenderer().render(simt.lower(k))
    assert not check_metal(metal) and not check_cuda(cuda)
    typo = check_metal(metal.replace("(dsl_tid & ", "(dsl_tdi & ", 1))
    assert any("undeclared identifier 'dsl_tdi'" in p.message for p in typo)
    body_end = metal.rstrip().rfind("}")
    for text, check in ((metal[:body_end] + "  x[0] = out[0];\n}\n", check_metal),  # a write through an input
                        (cuda.rstrip()[:-1] + "  x[0] = out[0];\n}\n", check_cuda),
                        (cuda.replace("const int dsl_tid", "float4 dsl_bad = 1; const int dsl_tid", 1), check_cuda)):
        assert check(text), text[-300:]
    # x + offset bound to a `device` pointer: right when MLX passes x in device memory, wrong in constant memory
    typed = "const device bfloat16_t* "
    assert not check_metal(metal.replace("auto ", typed, 1))
    assert any("cannot initialize" in p.message for p in check_metal(_metal_wrapped(k, 4).replace("auto ", typed, 1)))


@needs_mlx
@pytest.mark.parametrize("name,sig", [("rope", {"q": "*fp16", "k": "*fp16"}), ("rms_norm", {}),
                                      ("paged_decode_reduce", {})])
def test_mlx_wraps_our_body_as_we_reconstruct_it(name, sig):
    """MLX's own wrapper source, printed while mx.export_function traces a launch (no Metal needed), equals
    wrap_like_mlx; the launch itself maps pointers and scalars onto MLX inputs and outputs."""
    from backends.mlx.metal_kernel import MetalKernel, mlx_wrapped_source
    from backends.mlx.runtime import mx
    from kernels_src.dsl.metal_target import wrap_like_mlx

    k = REGISTRY[name].trace(signature=sig)
    kern = MetalKernel(simt.lower(k))
    args = [mx.zeros((64,), getattr(mx, _NP[p.dtype.elem.name])) if isinstance(p.dtype, PtrType)
            else (1.0 if p.dtype.is_float else 1) for p in k.params]
    got = mlx_wrapped_source(kern, (2, 1, 1), *args)
    assert got == wrap_like_mlx(kern.simt, kern.source, kern.header, kern.outputs, *args)
    assert "thread_index_in_threadgroup [[thread_index_in_threadgroup]]" in got


@needs_mlx
def test_metal_renders_in_the_dsl_and_launches_from_the_mlx_backend():
    """kernels_src renders Metal without importing a backend or mlx; compile(fn, "metal") launches only once
    backends.mlx.metal_kernel has registered its launcher. A fresh interpreter, so nothing registered it before."""
    code = textwrap.dedent("""
    import sys

    import numpy as np

    from kernels_src.dsl import compile
    from kernels_src.rms_norm import rms_norm_kernel

    x, w = np.zeros((2, 64), np.float32), np.ones(64, np.float32)
    args = (x, w, np.zeros_like(x), 64, 64, 64, 1e-6)
    k = compile(rms_norm_kernel, "metal", BLOCK=64, OFFSET=False)
    assert "threadgroup_position_in_grid" in k.source(*args)
    try:
        k.compiled(*args)
    except RuntimeError as e:
        assert "import backends.mlx.metal_kernel" in str(e), e
    else:
        raise SystemExit("the DSL launched Metal with no launcher registered")
    assert not [m for m in sys.modules if m.split(".")[0] in ("backends", "mlx")]
    from backends.mlx.metal_kernel import MetalKernel

    assert isinstance(k.compiled(*args), MetalKernel)
    print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_sources_render_for_every_target():
    x = trace(int_kernel, {"a": "*i32", "b": "*i32", "packed": "*u8", "half_bits": "*u8", "out_i": "*i32",
                           "out_f": "*fp32"})
    s = simt.lower(x)
    cpu = CpuRenderer().render(s)
    assert "dsl_launch" in cpu and "dsl::ld(" in cpu
    from kernels_src.dsl.cuda_target import CudaRenderer
    from kernels_src.dsl.metal_target import MetalRenderer

    assert 'extern "C" __global__ void __launch_bounds__(128) int_kernel(' in CudaRenderer().render(s)
    assert "metal::as_type<half>(" in MetalRenderer().render(s)
