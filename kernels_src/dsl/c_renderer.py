"""The C-like renderer of the SIMT form (simt.py): Metal, CUDA C and the CPU oracle's C++ are small subclasses.

A subclass sets attributes: type names, math function spellings, how thread and program ids read, how the
scratch area, barriers, simdgroup shuffles and reductions, global and threadgroup accesses are spelled, and the
signature / prologue around the body. The structure (loops, layouts, guards, barriers) is this class's alone, so
what the CPU oracle compiles is what the GPUs run, up to those spellings.
"""

from __future__ import annotations

import math

from .ir import DTYPES, DType, Op, PtrType, Value
from .renderer import Renderer
from .simt import SimtKernel

_HELPERS = """\
{fq} float dsl_erf(float a) {{  // N. Juffa's erff: |error| < 1 ulp
  float t = {fabs}(a), s = a * a, r, u;
  if (t > 0.927734375f) {{
    r = {fma}(-1.72853470e-5f, t, 3.83197126e-4f);
    u = {fma}(-3.88396438e-3f, t, 2.42546219e-2f);
    r = {fma}(r, s, u);
    r = {fma}(r, t, -1.06777877e-1f);
    r = {fma}(r, t, -6.34846687e-1f);
    r = {fma}(r, t, -1.28717512e-1f);
    r = {fma}(r, t, -t);
    r = {copysign}(1.0f - {exp}(r), a);
  }} else {{
    r = -5.96761703e-4f;
    r = {fma}(r, s, 4.99119423e-3f);
    r = {fma}(r, s, -2.67681349e-2f);
    r = {fma}(r, s, 1.12819925e-1f);
    r = {fma}(r, s, -3.76125336e-1f);
    r = {fma}(r, s, 1.28379166e-1f);
    r = {fma}(r, a, a);
  }}
  return r;
}}
template <typename T> {fq} T dsl_max(T a, T b) {{ return (a != a || a > b) ? a : b; }}  // NaN-propagating
template <typename T> {fq} T dsl_min(T a, T b) {{ return (a != a || a < b) ? a : b; }}
template <typename T> {fq} T dsl_abs(T a) {{ return a < T(0) ? T(-a) : a; }}
"""
MATH = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "erf", "floor", "ceil")


def _bitmap(r: CRenderer, op: Op, x: str) -> str:
    terms = []
    for src, dst, width in op.attrs["runs"]:
        t = f"({x} >> {src})" if src else x
        t = f"({t} & {(1 << width) - 1})"
        terms.append(f"({t} << {dst})" if dst else t)
    if len(terms) == 1:
        return terms[0]
    return "(" + " | ".join(terms) + ")" if terms else "0"


def _dot4(r: CRenderer, op: Op, a: str, b: str, acc: str) -> str:
    """A portable spelling of dp4a: 4 byte products in int32 (targets without the instruction)."""
    i32, u8, i8 = (r.dtype(DTYPES[n]) for n in ("i32", "u8", "i8"))

    def byte(w: str, k: int, signed: bool) -> str:
        v = f"static_cast<{u8}>({w} >> {8 * k})" if k else f"static_cast<{u8}>({w})"
        return f"static_cast<{i32}>(static_cast<{i8}>({v}))" if signed else f"static_cast<{i32}>({v})"
    sa, sb = op.attrs["signed_a"], op.attrs["signed_b"]
    return "(" + " + ".join([acc] + [f"{byte(a, k, sa)} * {byte(b, k, sb)}" for k in range(4)]) + ")"


def _gload(r: CRenderer, op: Op, p: str, off: str, mask: str | None = None, other: str | None = None) -> str:
    load = r.gload_fmt.format(p=p, o=off)
    return load if mask is None else f"({mask} ? {load} : {other})"


class CRenderer(Renderer):
    target = "c"
    stmt_end = ";"
    true, false = "true", "false"
    empty_body = ";"
    # --- what a target sets ---
    dtype_names = {"i1": "bool", "i8": "int8_t", "i16": "int16_t", "i32": "int32_t", "i64": "int64_t",
                   "u8": "uint8_t", "u16": "uint16_t", "u32": "uint32_t", "u64": "uint64_t", "fp16": "half",
                   "bf16": "bfloat16_t", "fp32": "float", "fp64": "double"}
    math_fns: dict[str, str] = {}  # name -> format of {0}
    helper_fns = dict(fq="inline", fabs="fabs", fma="fma", copysign="copysign", exp="exp")
    device_space = ""  # address space of global pointers ("device" in Metal)
    smem_space = ""  # address space of the scratch area ("threadgroup" in Metal)
    tid_expr = "threadIdx.x"
    pid_fmt = "blockIdx.{axis}"
    npid_fmt = "gridDim.{axis}"
    barrier_stmt = "__syncthreads();"
    shfl_fmt = "__shfl_xor_sync(0xffffffffu, {x}, {m})"
    simd_fmt = "dsl_warp_{kind}({x})"
    bitcast_fmt = "dsl_bitcast<{t}>({x})"
    gload_fmt = "{p}[{o}]"
    gstore_fmt = "{p}[{o}] = {v};"
    sload_fmt = "(({space}{t}*)(dsl_smem + {base}))[{i}]"
    sstore_fmt = "(({space}{t}*)(dsl_smem + {base}))[{i}] = {v};"
    unroll_pragma = "#pragma unroll"
    inf, nan = "INFINITY", "NAN"
    auto_pointers = False  # declare pointer locals `auto` (Metal: a param's address space depends on the launch)
    ptr_cast_fmt = "(({t}){p})"

    code_for_op = {
        "const": lambda r, op: r.literal(op.attrs["value"], op.result.dtype),
        "cast": lambda r, op, x: r.cast(x, op.args[0].dtype, op.result.dtype),
        "bitcast": lambda r, op, x: r.bitcast_fmt.format(t=r.dtype(op.result.dtype), x=x),
        "where": lambda r, op, c, a, b: f"({c} ? {a} : {b})",
        "max": lambda r, op, a, b: f"dsl_max({a}, {b})",
        "min": lambda r, op, a, b: f"dsl_min({a}, {b})",
        "abs": lambda r, op, x: f"dsl_abs({x})",
        "not": lambda r, op, x: f"(!{x})" if op.result.dtype.kind == "b" else f"(~{x})",
        "bitmap": _bitmap,
        "dot4": _dot4,
        "tid": lambda r, op: f"(int){r.tid_expr}",
        "program_id": lambda r, op: "(int)" + r.pid_fmt.format(axis="xyz"[op.attrs["axis"]], i=op.attrs["axis"]),
        "num_programs": lambda r, op: "(int)" + r.npid_fmt.format(axis="xyz"[op.attrs["axis"]], i=op.attrs["axis"]),
        "ptr_add": lambda r, op, p, o: f"({p} + {o})",
        "ptr_cast": lambda r, op, p: r.ptr_cast_fmt.format(t=r.ptr_decl(op.result), e=r.dtype(op.result.dtype.elem),
                                                           p=p),
        "var": lambda r, op, x: x,
        "get": lambda r, op, a, i: f"{a}[{i}]",
        "gload": _gload,
        "sload": lambda r, op, i: r.sload_fmt.format(space=r.space(r.smem_space), t=r.dtype(op.result.dtype),
                                                     base=op.attrs["base"], i=i),
        "shfl_xor": lambda r, op, x: r.shfl_fmt.format(x=x, m=op.attrs["mask"]),
        "simd_reduce": lambda r, op, x: r.simd_fmt.format(kind=op.attrs["kind"], x=x),
        **{m: (lambda r, op, x, m=m: r.math_fns[m].format(x)) for m in MATH},
    }
    infix = Renderer.infix | {"idiv": "/", "mod": "%"}

    # --- types and literals ------------------------------------------------------------------------------------

    @staticmethod
    def space(s: str) -> str:
        return f"{s} " if s else ""

    def ptr_decl(self, v: Value) -> str:
        const = "const " if v.id in self.kernel.readonly else ""
        return f"{const}{self.space(self.device_space)}{self.dtype(v.dtype.elem)}*"

    def ctype(self, v: Value) -> str:
        return self.ptr_decl(v) if isinstance(v.dtype, PtrType) else self.dtype(v.dtype)

    def literal(self, value, dtype: DType) -> str:
        t = self.dtype(dtype)
        if dtype.kind == "b":
            return self.true if value else self.false
        if dtype.is_int:
            v = int(value)
            if dtype.name == "i32" and -2**31 < v < 2**31:
                return str(v) if v >= 0 else f"({v})"
            suffix = ("U" if dtype.kind == "u" else "") + ("L" if dtype.bits == 64 else "")
            lit = f"({v + 1}{suffix} - 1)" if v == -(1 << (dtype.bits - 1)) else f"{v}{suffix}"
            return f"static_cast<{t}>({lit})"
        if math.isnan(value) or math.isinf(value):
            f = self.nan if math.isnan(value) else self.inf if value > 0 else f"(-{self.inf})"
        else:
            f = repr(float(value)) + ("" if dtype.name == "fp64" else "f")
        return f if dtype.name in ("fp32", "fp64") else f"static_cast<{t}>({f})"

    def cast(self, x: str, src: DType, dst: DType) -> str:
        if dst.kind == "b":
            return f"({x} != {self.literal(0, src)})"
        half = {"fp16", "bf16"}
        if (src.name in half or dst.name in half) and "fp32" not in (src.name, dst.name):
            x = f"static_cast<float>({x})"
        return f"static_cast<{self.dtype(dst)}>({x})"

    # --- statements ------------------------------------------------------------------------------------------

    def assign(self, v: Value, expr: str) -> str:
        t = "auto" if self.auto_pointers and isinstance(v.dtype, PtrType) else self.ctype(v)
        return f"{t} {self.name(v)} = {expr};"

    def render_const(self, op: Op, depth: int) -> list[str]:
        self.names[op.result.id] = self.expr(op)  # literals are spelled where used
        return []

    def line(self, depth: int, text: str) -> list[str]:
        return [self.indent * depth + text]

    def render_tid(self, op: Op, depth: int) -> list[str]:
        self.names[op.result.id] = "dsl_tid"
        return self.line(depth, f"const int dsl_tid = {self.expr(op)};")

    def render_alloc(self, op: Op, depth: int) -> list[str]:
        return self.line(depth, f"{self.dtype(op.result.dtype)} {self.name(op.result)}[{op.result.shape[0]}];")

    def render_set(self, op: Op, depth: int) -> list[str]:
        a, i, v = (self.name(x) for x in op.args)
        return self.line(depth, f"{a}[{i}] = {v};")

    def render_assign(self, op: Op, depth: int) -> list[str]:
        return self.line(depth, f"{self.name(op.args[0])} = {self.name(op.args[1])};")

    def render_gstore(self, op: Op, depth: int) -> list[str]:
        p, o, v = (self.name(x) for x in op.args)
        return self.line(depth, self.gstore_fmt.format(p=p, o=o, v=v))

    def render_sstore(self, op: Op, depth: int) -> list[str]:
        i, v = (self.name(x) for x in op.args)
        return self.line(depth, self.sstore_fmt.format(space=self.space(self.smem_space),
                                                       t=self.dtype(op.args[1].dtype), base=op.attrs["base"],
                                                       i=i, v=v))

    def render_barrier(self, op: Op, depth: int) -> list[str]:
        return self.line(depth, self.barrier_stmt)

    def render_if(self, op: Op, depth: int) -> list[str]:
        return (self.line(depth, f"if ({self.name(op.args[0])}) {{") + self.render_block(op.body, depth + 1)
                + self.line(depth, "}"))

    def render_loop(self, op: Op, depth: int) -> list[str]:
        lo, hi = (self.name(a) for a in op.args)
        step = op.attrs["step"]
        self.names[op.body.args[0].id] = i = f"i{op.body.args[0].id}"
        head = f"for (int {i} = {lo}; {i} {'<' if step > 0 else '>'} {hi}; {i} += {step}) {{"
        pragma = self.line(depth, self.unroll_pragma) if op.attrs.get("unroll") and self.unroll_pragma else []
        return pragma + self.line(depth, head) + self.render_block(op.body, depth + 1) + self.line(depth, "}")

    # --- the kernel ------------------------------------------------------------------------------------------

    def helpers(self) -> str:
        return _HELPERS.format(**self.helper_fns)

    def smem_decl(self, k: SimtKernel) -> list[str]:
        raise NotImplementedError

    def body_lines(self, k: SimtKernel, depth: int = 1) -> list[str]:
        lines = self.smem_decl(k) if k.smem_bytes else []
        return [self.indent * depth + s for s in lines] + self.render_block(k.body, depth)

    def render(self, k: SimtKernel) -> str:
        self.kernel, self.names = k, {}
        body = self.body_lines(k)
        return "\n".join(self.prologue(k) + body + self.epilogue(k)) + "\n"
