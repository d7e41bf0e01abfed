"""The CPU oracle of the SIMT form: the C-like renderer's C++ "thread loop" twin, compiled with the system C++
compiler and run in-process (target "simt-cpu").

Every thread of a threadgroup runs the rendered body as a fiber (cpu_runtime.h): barriers and simdgroup
collectives are the points where fibers wait for each other, threadgroup memory is race-checked per byte and
global accesses are bounds-checked, so layouts, barriers and reductions are exercised as the Metal and CUDA
sources have them. Built libraries are cached by source hash next to the Triton sources.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np

from .c_renderer import CRenderer
from .interpreter import _as_buffer
from .ir import KernelIR, PtrType
from .simt import SimtKernel, lower

RUNTIME = Path(__file__).with_name("cpu_runtime.h")
FLAGS = ("-std=c++17", "-O0", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-w")


class CpuRenderer(CRenderer):
    target = "simt-cpu"
    dtype_names = CRenderer.dtype_names | {"fp16": "dsl::half", "bf16": "dsl::bfloat"}
    math_fns = {m: f"std::{m}({{0}})" for m in ("exp", "exp2", "log", "log2", "sqrt", "sin", "cos", "tanh",
                                                "floor", "ceil")} | {"rsqrt": "(1.0f / std::sqrt({0}))",
                                                                     "erf": "dsl_erf({0})"}
    helper_fns = dict(fq="static inline", fabs="std::fabs", fma="std::fma", copysign="std::copysign", exp="std::exp")
    tid_expr = "dsl::tid()"
    pid_fmt = "dsl::pid({i})"
    npid_fmt = "dsl::npid({i})"
    barrier_stmt = "dsl::barrier(__LINE__);"
    shfl_fmt = "dsl::shfl_xor({x}, {m})"
    simd_fmt = "dsl::simd_{kind}({x})"
    gload_fmt = "dsl::ld({p}, {o})"
    gstore_fmt = "dsl::st({p}, {o}, {v});"
    sload_fmt = "dsl::sld<{t}>({base}, {i})"
    sstore_fmt = "dsl::sst<{t}>({base}, {i}, {v});"
    unroll_pragma = ""

    def smem_decl(self, k: SimtKernel) -> list[str]:
        return []  # the runtime owns the scratch area (sld/sst)

    def prologue(self, k: SimtKernel) -> list[str]:
        lines = ['#include "cpu_runtime.h"', "", self.helpers(),
                 'extern "C" __attribute__((visibility("default"))) const char* dsl_launch(',
                 "    const int* grid, void** args, int nalloc, const uintptr_t* lo, const size_t* nbytes) {"]
        for i, p in enumerate(k.params):
            t = self.ctype(p)
            cast = f"({t})args[{i}]" if isinstance(p.dtype, PtrType) else f"*(const {t}*)args[{i}]"
            lines.append(f"  {t} {p.name} = {cast};")
        lines += ["  std::vector<std::pair<uintptr_t, size_t>> allocs;",
                  "  for (int i = 0; i < nalloc; ++i) allocs.emplace_back(lo[i], nbytes[i]);",
                  "  std::function<void()> body = [&]() {"]
        return lines

    def body_lines(self, k: SimtKernel, depth: int = 2) -> list[str]:
        return super().body_lines(k, depth)

    def epilogue(self, k: SimtKernel) -> list[str]:
        return ["  };", f"  return dsl::run_grid(grid, {k.nthreads}, {k.smem_bytes}, allocs, body);", "}"]


def build(source: str) -> ctypes.CDLL:
    """The shared library of a rendered C++ source, compiled once per (source, runtime, flags)."""
    from .triton_target import cache_dir

    cxx = os.environ.get("CXX", "g++")
    key = "\n".join([source, RUNTIME.read_text(), cxx, *FLAGS])
    path = cache_dir() / f"simt_cpu_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not path.exists():
        cpp = path.with_suffix(f".{os.getpid()}.cpp")
        cpp.write_text(source)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            res = subprocess.run([cxx, *FLAGS, "-I", str(RUNTIME.parent), str(cpp), "-o", str(tmp)],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{cxx} failed on the rendered SIMT kernel:\n{res.stderr[-4000:]}")
            os.replace(tmp, path)
        finally:
            cpp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    lib.dsl_launch.restype = ctypes.c_char_p
    return lib


class SimtError(RuntimeError):
    """A race, an out-of-bounds access or divergent barriers found while running the SIMT form."""


class CpuKernel:
    """`launch(grid, *args)` of the rendered SIMT kernel on the CPU; arrays as for the numpy interpreter."""

    def __init__(self, simt: SimtKernel):
        self.simt = simt
        self.source = CpuRenderer().render(simt)
        self.lib = build(self.source)

    def __call__(self, grid, *args) -> None:
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        grid = (ctypes.c_int * 3)(*(tuple(grid) + (1,) * (3 - len(grid))))
        keep, ptrs, allocs = [], [], []
        for p, a in zip(self.simt.params, args, strict=True):
            if isinstance(p.dtype, PtrType):
                buf = _as_buffer(a, p.dtype.elem)
                keep.append(buf.buf)
                base = buf.buf.ctypes.data
                ptrs.append(base + buf.off * buf.buf.itemsize)
                allocs.append((base, buf.buf.nbytes))
            else:
                v = np.asarray(a, dtype=p.dtype.np if p.dtype.name != "bf16" else np.float32).reshape(1)
                keep.append(v)
                ptrs.append(v.ctypes.data)
        argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
        lo = (ctypes.c_size_t * len(allocs))(*(b for b, _ in allocs))
        nbytes = (ctypes.c_size_t * len(allocs))(*(n for _, n in allocs))
        err = self.lib.dsl_launch(grid, argv, len(allocs), lo, nbytes)
        if err:
            raise SimtError(f"{self.simt.name}: {err.decode()}")


def render(k: KernelIR, num_warps: int = 4) -> str:
    return CpuRenderer().render(lower(k, num_warps))


def compile_kernel(k: KernelIR, num_warps: int = 4) -> CpuKernel:
    return CpuKernel(lower(k, num_warps))
