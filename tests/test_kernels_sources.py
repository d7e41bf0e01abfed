"""The kernels' C-like sources without a GPU: the Metal source as MLX wraps it and the CUDA C parse with libclang
(planted mistakes are caught), MLX wraps our body as we reconstruct it, the Metal launcher lives in the MLX backend
(the DSL renders without it), and every target renders (split from test_kernels_simt.py, whose SIMT oracle runs the
same lowering)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest
from test_kernels_dsl import int_kernel

from kernels_src.dsl import simt, trace
from kernels_src.dsl.cpu_target import CpuRenderer
from kernels_src.dsl.ir import PtrType
from kernels_src.dsl.simt_targets import lowered  # one lowering per kernel for its Metal and CUDA C parses
from kernels_src.registry import REGISTRY

HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_CLANG = importlib.util.find_spec("clang") is not None
needs_clang = pytest.mark.skipif(not HAS_CLANG, reason="libclang not installed (pip install libclang)")
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx not installed")


# --- parse checks: Metal as MLX wraps it, CUDA C --------------------------------------------------------------

class _Arr:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


_NP = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "i32": "int32", "i64": "int64", "u8": "uint8",
       "i8": "int8"}


def _metal_wrapped(k, n: int) -> str:
    from kernels_src.dsl.metal_target import MetalRenderer, default_outputs, wrap_like_mlx

    s, r = lowered(k, 4), MetalRenderer()
    args = [_Arr((n,), _NP[p.dtype.elem.name]) if isinstance(p.dtype, PtrType) else 1 for p in k.params]
    return wrap_like_mlx(s, r.render(s), r.header(), default_outputs(s), *args)


# GEMV formats added after the first five share the kernel body and emitters with them; of those, only Q5_K's source
# (~10 s of libclang each) is parse-checked here (the GPU tests compile them all with CuPy).
PARSE_SKIP = {f"dequant_gemv_{q.lower()}" for q in ("Q5_0", "Q5_1", "Q2_K", "Q3_K")}
SIMT_REFUSED = {"fp8_gemm"}


@needs_clang
@pytest.mark.parametrize("name", [n for n in REGISTRY if n not in PARSE_SKIP])
def test_parse_metal_and_cuda(name):
    from kernels_src.dsl.cuda_target import CudaRenderer
    from kernels_src.dsl.parse_check import check_cuda, check_metal

    e = REGISTRY[name]
    # the SIMT targets have no FP8 type: kernels that decode e4m3 by its conversion take the integer ops there; a
    # kernel built on FP8 dots is refused (tests/test_kernels_fp8_gemm.py checks the refusal)
    if name in SIMT_REFUSED:
        pytest.skip(f"{name} runs on FP8 tensor cores only: the SIMT targets refuse it")
    k = e.trace(FP8_CVT=False) if "FP8_CVT" in e.constexprs else e.trace()
    for n in (4096, 4):  # inputs in `device` memory, and in `constant` memory (MLX: fewer than 8 elements)
        problems = check_metal(_metal_wrapped(k, n))
        assert not problems, "\n".join(map(str, problems))
    problems = check_cuda(CudaRenderer().render(lowered(k, 4)))
    assert not problems, "\n".join(map(str, problems))


@needs_clang
def test_parse_metal_and_cuda_int8_gemv():
    """The int8-activation path (a registry variant, not an entry of its own): its MSL and CUDA C parse too. Q4_K and
    Q6_K: Q5_K's is Q4_K's and the qh loads of its fp32 kernel, parsed as the dequant_gemv_q5_k entry."""
    from kernels_src.dequant_gemv_i8 import traces
    from kernels_src.dsl.cuda_target import CudaRenderer
    from kernels_src.dsl.parse_check import check_cuda, check_metal

    for k in traces("fp16", qtypes=("Q4_K", "Q6_K")):
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
