"""The Metal emitter: the SIMT form (simt.py) spelled as the *body* that `mx.fast.metal_kernel` wraps, and a
launcher (target "metal"). One threadgroup per program; MLX's `grid` counts threads, so it is
(programs_x * nthreads, programs_y, programs_z) with threadgroup (nthreads, 1, 1).

MLX arrays are values, so pointers map onto its inputs and outputs thus: a pointer only loaded is an input; a
pointer written and never loaded is, by default, a fresh output (returned; give `outputs=` to choose); every
other written pointer is updated IN PLACE: MLX passes it as the input `<name>_in` and the body writes through a
cast-away-const pointer. Such an array must be evaluated and row-contiguous (else MLX hands the kernel a copy),
and the write happens when the kernel runs: the launcher returns the array made to depend on the kernel
(`mx.depends`), and that returned array is the one to use afterwards. Scalars become 0-d inputs
(`const constant T& name`), and MLX makes inputs row-contiguous, so strides must be those of contiguous arrays.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from .c_renderer import CRenderer
from .ir import PtrType
from .simt import SimtKernel

_MX = {"i1": "bool_", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u16": "uint16",
       "u32": "uint32", "u64": "uint64", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


# MLX passes an input of fewer than 8 elements in `constant` memory, others in `device` memory: pointer casts
# keep whichever address space they get.
_PTR_CASTS = """\
template <typename To, typename From> inline const device To* dsl_ptr_cast(const device From* p) {
  return (const device To*)p;
}
template <typename To, typename From> inline const constant To* dsl_ptr_cast(const constant From* p) {
  return (const constant To*)p;
}
template <typename To, typename From> inline device To* dsl_ptr_cast(device From* p) { return (device To*)p; }
"""


class MetalRenderer(CRenderer):
    target = "metal"
    math_fns = {m: f"metal::{m}({{0}})" for m in ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos",
                                                  "tanh", "floor", "ceil")} | {"erf": "dsl_erf({0})"}
    helper_fns = dict(fq="inline", fabs="metal::fabs", fma="metal::fma", copysign="metal::copysign", exp="metal::exp")
    device_space, smem_space = "device", "threadgroup"
    tid_expr = "thread_index_in_threadgroup"
    pid_fmt = "threadgroup_position_in_grid.{axis}"
    npid_fmt = "threadgroups_per_grid.{axis}"
    barrier_stmt = "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);"
    shfl_fmt = "metal::simd_shuffle_xor({x}, (ushort){m})"
    simd_fmt = "metal::simd_{kind}({x})"
    bitcast_fmt = "metal::as_type<{t}>({x})"
    unroll_pragma = "#pragma clang loop unroll(full)"
    auto_pointers = True
    ptr_cast_fmt = "dsl_ptr_cast<{e}>({p})"

    def dtype(self, t):
        if getattr(t, "name", None) == "fp64":
            raise NotImplementedError("Metal has no fp64")
        return super().dtype(t)

    def header(self) -> str:
        """The `header=` of mx.fast.metal_kernel: helpers shared by every kernel."""
        return "#include <metal_stdlib>\n\n" + self.helpers() + _PTR_CASTS

    def smem_decl(self, k: SimtKernel) -> list[str]:
        return [f"threadgroup float4 dsl_smem4[{k.smem_bytes // 16}];",
                "threadgroup uchar* dsl_smem = (threadgroup uchar*)dsl_smem4;"]

    def prologue(self, k: SimtKernel) -> list[str]:
        lines = [f"{self.indent}// {k.name}: generated from the kernel DSL (SIMT form, {k.nthreads} threads a "
                 "threadgroup)"]
        for p in k.params:
            if p.name in inplace_params(k, self.outputs):
                lines.append(f"{self.indent}{self.ctype(p)} {p.name} = ({self.ctype(p)})({p.name}_in);")
        return lines

    def render(self, k: SimtKernel, outputs: set[str] | None = None) -> str:
        self.outputs = default_outputs(k) if outputs is None else set(outputs)
        return super().render(k)


def default_outputs(k: SimtKernel) -> set[str]:
    return k.written - k.loaded


def inplace_params(k: SimtKernel, outputs: set[str]) -> list[str]:
    return [p.name for p in k.params if p.name in k.written and p.name not in outputs]


def io_names(k: SimtKernel, outputs: set[str]) -> tuple[list[str], list[str]]:
    """(input_names, output_names) for mx.fast.metal_kernel, in parameter order."""
    inplace = inplace_params(k, outputs)
    inputs = [p.name + ("_in" if p.name in inplace else "") for p in k.params if p.name not in outputs]
    outs = [p.name for p in k.params if p.name in outputs]
    return inputs, outs or ["dsl_done"]  # MLX wants at least one output


class MetalKernel:
    """`launch(grid, *args, verbose=False) -> {pointer name: mx.array}` for every written pointer."""

    def __init__(self, simt: SimtKernel, outputs: set[str] | None = None):
        from backends.mlx.runtime import mx

        self.simt, self.mx = simt, mx
        self.outputs = default_outputs(simt) if outputs is None else set(outputs)
        unknown = self.outputs - simt.written
        if unknown:
            raise ValueError(f"{simt.name}: {sorted(unknown)} are not written by the kernel")
        r = MetalRenderer()
        self.source, self.header = r.render(simt, self.outputs), r.header()
        self.input_names, self.output_names = io_names(simt, self.outputs)
        self.fn = mx.fast.metal_kernel(name=simt.name, input_names=self.input_names, output_names=self.output_names,
                                       source=self.source, header=self.header, ensure_row_contiguous=True)

    def __call__(self, grid, *args, verbose: bool = False, stream=None) -> dict:
        mx = self.mx
        grid = (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid)
        grid = grid + (1,) * (3 - len(grid))
        inputs, shapes, dtypes, inplace = [], [], [], []
        for p, a in zip(self.simt.params, args, strict=True):
            if not isinstance(p.dtype, PtrType):
                inputs.append(mx.array(a, dtype=getattr(mx, _MX[p.dtype.name])))
            elif p.name in self.outputs:
                shapes.append(tuple(a.shape))
                dtypes.append(a.dtype)
            else:
                inputs.append(a)
                if p.name in self.simt.written:
                    inplace.append((p.name, a))
        if not shapes:
            shapes, dtypes = [(1,)], [mx.int32]
        outs = self.fn(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes,
                       grid=(grid[0] * self.simt.nthreads, grid[1], grid[2]), threadgroup=(self.simt.nthreads, 1, 1),
                       verbose=verbose, **({} if stream is None else {"stream": stream}))
        result = dict(zip(self.output_names, outs, strict=True)) if self.outputs else {}
        for name, a in inplace:
            result[name] = mx.depends([a], list(outs))[0]
        return result


def mlx_wrapped_source(kernel: MetalKernel, grid, *args) -> str:
    """The full Metal source MLX builds for this launch (signature + body), as mlx prints it with verbose=True.

    MLX writes it while tracing the call, which works without a Metal device inside `mx.export_function` (it
    records the kernel for another machine instead of running it); its stdout (C++) is captured at the fd level.
    """
    mx = kernel.mx
    arrays = [a for p, a in zip(kernel.simt.params, args, strict=True) if isinstance(p.dtype, PtrType)]

    def fn(*arrs):
        it = iter(arrs)
        full = [next(it) if isinstance(p.dtype, PtrType) else a for p, a in zip(kernel.simt.params, args, strict=True)]
        return list(kernel(grid, *full, verbose=True).values())

    with tempfile.TemporaryFile(mode="w+b") as out, _stdout_to(out):
        mx.export_function(lambda *_: None, fn, *arrays)
        out.seek(0)
        text = out.read().decode()
    start = text.find("```\n")
    end = text.rfind("```")
    if start < 0 or end <= start:
        raise RuntimeError(f"mlx printed no kernel source:\n{text[:2000]}")
    return text[start + 4:end - 1]  # less the newline mlx prints after the source


@contextlib.contextmanager
def _stdout_to(f):
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(f.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# MLX's write_signature (mlx/fast.cpp), for checks on machines without mlx; tests compare it with the real one.
_MLX_TYPES = {"bool": "bool", "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
              "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "float16": "float16_t",
              "bfloat16": "bfloat16_t", "float32": "float"}
_MLX_ATTRS = [("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
              ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
              ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
              ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
              ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
              ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
              ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
              ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
              ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3")]


def wrap_like_mlx(simt: SimtKernel, source: str, header: str, outputs: set[str], *args) -> str:
    """The source MLX would compile for a launch with `args` (arrays: anything with .shape and .dtype)."""
    inputs, outs = io_names(simt, outputs)
    arrays = [(p, a) for p, a in zip(simt.params, args, strict=True) if p.name not in outputs]
    sig, name = [], "custom_kernel_" + simt.name
    for in_name, (p, a) in zip(inputs, arrays, strict=True):
        shape = tuple(getattr(a, "shape", ()))
        size = 1
        for s in shape:
            size *= s
        t = _MLX_TYPES[str(a.dtype).rsplit(".", 1)[-1]] if shape else _MLX_TYPES[_MX[p.dtype.name].rstrip("_")]
        ref, space = ("&" if not shape else "*"), ("constant" if size < 8 else "device")
        name += "_" + t + ("s" if not shape else "c" if size < 8 else "")
        sig.append(f"  const {space} {t}{ref} {in_name} [[buffer({len(sig)})]]")
        for suffix, decl in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                             ("_ndim", "const constant int&")):
            if shape and in_name + suffix in source:
                sig.append(f"  {decl} {in_name}{suffix} [[buffer({len(sig)})]]")
    out_types = [_MLX_TYPES[str(a.dtype).rsplit(".", 1)[-1]] for p, a in zip(simt.params, args, strict=True)
                 if p.name in outputs] or ["int32_t"]
    for o, t in zip(outs, out_types, strict=True):
        name += "_" + t
        sig.append(f"  device {t}* {o} [[buffer({len(sig)})]]")
    sig += [f"  {t} {a} [[{a}]]" for a, t in _MLX_ATTRS if a in source]
    return f"{header}[[kernel]] void {name}(\n" + ",\n".join(sig) + ") {\n" + source + "\n}\n"
