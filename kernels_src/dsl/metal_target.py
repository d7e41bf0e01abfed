"""The Metal emitter: the SIMT form (simt.py) spelled as the *body* that `mx.fast.metal_kernel` wraps (target
"metal"), with the names of its inputs and outputs (`metal_program`). The launcher, which needs mlx, is the MLX
backend's (backends/mlx/metal_kernel.py registers it). One threadgroup per program; MLX's `grid` counts threads, so
it is (programs_x * nthreads, programs_y, programs_z) with threadgroup (nthreads, 1, 1).

MLX arrays are values, so pointers map onto its inputs and outputs thus: a pointer only loaded is an input; a
pointer written and never loaded is, by default, a fresh output (returned; give `outputs=` to choose); every
other written pointer is updated IN PLACE: MLX passes it as the input `<name>_in` and the body writes through a
cast-away-const pointer. Such an array must be evaluated and row-contiguous (else MLX hands the kernel a copy),
and the write happens when the kernel runs: the launcher returns the array made to depend on the kernel
(`mx.depends`), and that returned array is the one to use afterwards. Scalars become 0-d inputs
(`const constant T& name`), and MLX makes inputs row-contiguous, so strides must be those of contiguous arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

from .c_renderer import CRenderer
from .simt import SimtKernel

# DSL scalar type -> mlx dtype name: scalars reach a kernel as 0-d arrays of these.
MLX_DTYPES = {"i1": "bool_", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
              "u16": "uint16", "u32": "uint32", "u64": "uint64", "fp16": "float16", "bf16": "bfloat16",
              "fp32": "float32"}


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


@dataclass(frozen=True)
class MetalProgram:
    """One kernel as mx.fast.metal_kernel takes it, and what a launch maps its arguments by. The DSL stops here:
    running it needs mlx, so the launcher is the MLX backend's (backends/mlx/metal_kernel.py)."""

    simt: SimtKernel
    outputs: frozenset[str]  # pointers that come back as fresh arrays; other written ones are updated in place
    source: str  # the kernel body
    header: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


def metal_program(simt: SimtKernel, outputs: set[str] | None = None) -> MetalProgram:
    """Render `simt` for mx.fast.metal_kernel; `outputs` as in the module's docstring (None: the default)."""
    outputs = default_outputs(simt) if outputs is None else set(outputs)
    unknown = outputs - simt.written
    if unknown:
        raise ValueError(f"{simt.name}: {sorted(unknown)} are not written by the kernel")
    r = MetalRenderer()
    inputs, outs = io_names(simt, outputs)
    return MetalProgram(simt, frozenset(outputs), r.render(simt, outputs), r.header(), tuple(inputs), tuple(outs))


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
        t = _MLX_TYPES[str(a.dtype).rsplit(".", 1)[-1] if shape else MLX_DTYPES[p.dtype.name].rstrip("_")]
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
