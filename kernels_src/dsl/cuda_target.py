"""The CUDA C twin of the Metal emitter: the same SIMT form (simt.py) spelled as one `extern "C" __global__`
kernel, launched with CuPy's RawKernel (target "cuda"): one CUDA block per program, num_warps * 32 threads.

Launch: `CudaKernel(simt)(grid, *args)`; pointers are CuPy arrays, torch CUDA tensors or anything with
`data_ptr()` / `__cuda_array_interface__` (a view's first element is the pointer, as everywhere in the DSL),
scalars are Python or numpy numbers. It runs on CuPy's current stream (`with cupy.cuda.ExternalStream(
torch.cuda.current_stream().cuda_stream):` to follow torch's).
"""

from __future__ import annotations

import numpy as np

from .c_renderer import MATH, CRenderer
from .ir import PtrType
from .simt import SimtKernel

_CUDA_HELPERS = """\
template <typename To, typename From> __device__ __forceinline__ To dsl_bitcast(From x) {
  To y;
  memcpy(&y, &x, sizeof(To));
  return y;
}
template <typename T> __device__ __forceinline__ T dsl_warp_sum(T x) {
  for (int m = 16; m > 0; m >>= 1) x = x + __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}
template <typename T> __device__ __forceinline__ T dsl_warp_max(T x) {
  for (int m = 16; m > 0; m >>= 1) x = dsl_max(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
template <typename T> __device__ __forceinline__ T dsl_warp_min(T x) {
  for (int m = 16; m > 0; m >>= 1) x = dsl_min(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
"""


class CudaRenderer(CRenderer):
    target = "cuda"
    dtype_names = {"i1": "bool", "i8": "signed char", "i16": "short", "i32": "int", "i64": "long long",
                   "u8": "unsigned char", "u16": "unsigned short", "u32": "unsigned int",
                   "u64": "unsigned long long", "fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float",
                   "fp64": "double"}
    math_fns = {m: f"{m}f({{0}})" for m in MATH}
    helper_fns = dict(fq="__device__ __forceinline__", fabs="fabsf", fma="fmaf", copysign="copysignf", exp="expf")
    inf, nan = "__int_as_float(0x7f800000)", "__int_as_float(0x7fffffff)"

    def smem_decl(self, k: SimtKernel) -> list[str]:
        return [f"__shared__ float4 dsl_smem4[{k.smem_bytes // 16}];",
                "unsigned char* dsl_smem = (unsigned char*)dsl_smem4;"]

    def prologue(self, k: SimtKernel) -> list[str]:
        params = ", ".join(f"{self.ctype(p)} {p.name}" for p in k.params)
        return ["#include <cuda_fp16.h>", "#include <cuda_bf16.h>", "",
                f"// {k.name}: generated from the kernel DSL (SIMT form, {k.nthreads} threads a block)",
                self.helpers() + _CUDA_HELPERS,
                f'extern "C" __global__ void __launch_bounds__({k.nthreads}) {k.name}({params}) {{']

    def epilogue(self, k: SimtKernel) -> list[str]:
        return ["}"]


def _pointer(a):
    if hasattr(a, "data_ptr"):  # torch
        return np.uint64(a.data_ptr())
    if hasattr(a, "__cuda_array_interface__"):
        return np.uint64(a.__cuda_array_interface__["data"][0])
    raise TypeError(f"cannot pass {type(a).__name__} as a device pointer")


class CudaKernel:
    """`launch(grid, *args)` of the rendered CUDA C through cupy.RawKernel (compiled by NVRTC on first call)."""

    def __init__(self, simt: SimtKernel, options: tuple[str, ...] = ("--std=c++17",)):
        import cupy

        self.simt = simt
        self.source = CudaRenderer().render(simt)
        self.fn = cupy.RawKernel(self.source, simt.name, options=options)

    def __call__(self, grid, *args) -> None:
        grid = (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid)
        argv = []
        for p, a in zip(self.simt.params, args, strict=True):
            if isinstance(p.dtype, PtrType):
                argv.append(_pointer(a))
            else:
                argv.append(np.asarray(a, dtype=p.dtype.np)[()])
        self.fn(grid + (1,) * (3 - len(grid)), (self.simt.nthreads, 1, 1), tuple(argv))
