"""The SIMT emitters as DSL targets: "simt-cpu" (the C++ oracle, runs here), "cuda" (CUDA C through CuPy) and
"metal" (Metal through mx.fast.metal_kernel, launched by backends/mlx/metal_kernel.py once imported).
`compile(fn, target)[grid](*args)` works for each; `.source()` gives the rendered text. Lowering and rendering are
cached per traced kernel."""

from __future__ import annotations

import weakref

from .ir import KernelIR
from .launch import register_target

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KernelIR -> {key: lowered form or source}


def _cached(k: KernelIR, key, make):
    per = _cache.setdefault(k, {})
    if key not in per:
        per[key] = make()
    return per[key]


def lowered(k: KernelIR, num_warps: int):
    from .simt import lower

    return _cached(k, num_warps, lambda: lower(k, num_warps))


def _cpu_render(k, num_warps):
    from .cpu_target import CpuRenderer

    return _cached(k, ("cpu", num_warps), lambda: CpuRenderer().render(lowered(k, num_warps)))


def _cpu_build(k, num_warps):
    from .cpu_target import CpuKernel

    return CpuKernel(lowered(k, num_warps))


def _cuda_render(k, num_warps):
    from .cuda_target import CudaRenderer

    return _cached(k, ("cuda", num_warps), lambda: CudaRenderer().render(lowered(k, num_warps)))


def _cuda_build(k, num_warps):
    from .cuda_target import CudaKernel

    return CudaKernel(lowered(k, num_warps))


def _metal_render(k, num_warps):
    from .metal_target import MetalRenderer

    return _cached(k, ("metal", num_warps), lambda: MetalRenderer().render(lowered(k, num_warps)))


def _metal_build(k, num_warps):
    # Running Metal needs mlx, which is the MLX backend's to import: its launcher replaces this one.
    raise RuntimeError(f"{k.name}: target 'metal' launches through mlx; import backends.mlx.metal_kernel first, "
                       "which registers the launcher (the DSL itself only renders the source)")


register_target("simt-cpu", _cpu_render, _cpu_build)
register_target("cuda", _cuda_render, _cuda_build)
register_target("metal", _metal_render, _metal_build)


def listing(target: str, k: KernelIR, num_warps: int = 4) -> str:
    """What tools/dump_kernel prints for a SIMT target; for Metal, the metal_kernel call with header and body."""
    if target == "simt-cpu":
        return _cpu_render(k, num_warps)
    if target == "cuda":
        return _cuda_render(k, num_warps)
    from .metal_target import MetalRenderer, default_outputs, io_names

    s, r = lowered(k, num_warps), MetalRenderer()
    body = r.render(s)
    inputs, outputs = io_names(s, default_outputs(s))
    return "\n".join([
        f"// mx.fast.metal_kernel(name={s.name!r}, input_names={inputs}, output_names={outputs}, header=, source=)",
        f"// launch: grid=(programs_x * {s.nthreads}, programs_y, programs_z), threadgroup=({s.nthreads}, 1, 1); "
        f"threadgroup memory {s.smem_bytes} B",
        "// ---- header ----", r.header().rstrip(), "// ---- source (the kernel body) ----", body.rstrip()])
