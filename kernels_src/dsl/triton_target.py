"""The Triton target: KernelIR -> Triton Python source -> `triton.jit` (or Triton's interpreter), and AOT builds.

Constexprs are folded into the source while tracing, so the emitted function takes only runtime parameters.
The source is written to a file named by its hash because `triton.jit` reads a function's source from its file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from .ir import GRID_DEP, KernelIR, Op
from .renderer import Renderer


def _typed(r: Renderer, op: Op) -> str:
    t = op.result.dtype
    return f"tl.full((), {r.literal(op.attrs['value'], t)}, {r.dtype(t)})"


def _const(r: Renderer, op: Op) -> str:
    # Python literals are weakly typed in Triton; only i32/fp32/bool literals are exactly what the IR says.
    if op.result.dtype.name in ("i32", "fp32", "i1"):
        return r.literal(op.attrs["value"], op.result.dtype)
    return _typed(r, op)


def _broadcast(r: Renderer, op: Op, x: str) -> str:
    return f"tl.broadcast_to({x}, {tuple(op.attrs['shape'])})"


def _dot(r: Renderer, op: Op, a: str, b: str) -> str:
    precision = ', input_precision="ieee"' if op.args[0].dtype.name == "fp32" else ""
    return f"tl.dot({a}, {b}{precision})"


def _load(r: Renderer, op: Op, p: str, mask: str | None = None, other: str | None = None) -> str:
    return f"tl.load({p}" + (f", mask={mask}" if mask else "") + (f", other={other}" if other else "") + ")"


def _atomic_add(r: Renderer, op: Op, p: str, v: str, mask: str | None = None) -> str:
    m = f", mask={mask}" if mask else ""
    return f'tl.atomic_add({p}, {v}{m}, sem="{op.attrs["sem"]}", scope="{op.attrs["scope"]}")'


def _dot4(r: TritonRenderer, op: Op, a: str, b: str, acc: str) -> str:
    """PTX dp4a through inline assembly; under Triton's interpreter (which runs no assembly) 4 byte products."""
    sa, sb = op.attrs["signed_a"], op.attrs["signed_b"]
    if r.interpret:
        def byte(w: str, k: int, signed: bool) -> str:
            if signed:
                return f"(tl.cast({w} << {24 - 8 * k}, tl.int32, bitcast=True) >> 24)"
            return f"tl.cast(({w} >> {8 * k}) & 255, tl.int32)"
        return "(" + " + ".join([acc] + [f"{byte(a, k, sa)} * {byte(b, k, sb)}" for k in range(4)]) + ")"
    kind = f"{'s' if sa else 'u'}32.{'s' if sb else 'u'}32"
    return (f'tl.inline_asm_elementwise("dp4a.{kind} $0, $1, $2, $3;", "=r,r,r,r", [{a}, {b}, {acc}], '
            "dtype=tl.int32, is_pure=True, pack=1)")


def _call(fn: str):
    return lambda r, op, x: f"{fn}({x})"


class TritonRenderer(Renderer):
    target = "triton"
    dtype_names = {"i1": "tl.int1", "i8": "tl.int8", "i16": "tl.int16", "i32": "tl.int32", "i64": "tl.int64",
                   "u8": "tl.uint8", "u16": "tl.uint16", "u32": "tl.uint32", "u64": "tl.uint64",
                   "fp16": "tl.float16", "bf16": "tl.bfloat16", "fp32": "tl.float32", "fp64": "tl.float64",
                   "fp8e4nv": "tl.float8e4nv"}
    infix = Renderer.infix | {"idiv": "//", "mod": "%", "ptr_add": "+"}

    def __init__(self, interpret: bool = False):
        self.interpret = interpret  # source for Triton's interpreter: no inline assembly
    code_for_op = {
        "const": lambda r, op: _const(r, op),
        "program_id": lambda r, op: f"tl.program_id({op.attrs['axis']})",
        "num_programs": lambda r, op: f"tl.num_programs({op.attrs['axis']})",
        "arange": lambda r, op: f"tl.arange({op.attrs['start']}, {op.attrs['end']})",
        # tl.cast, not x.to: the interpreter hands loop counters over as Python ints
        "cast": lambda r, op, x: f"tl.cast({x}, {r.dtype(op.result.dtype)})",
        "bitcast": lambda r, op, x: f"tl.cast({x}, {r.dtype(op.result.dtype)}, bitcast=True)",
        "ptr_cast": lambda r, op, x: f"{x}.to(tl.pointer_type({r.dtype(op.result.dtype.elem)}))",
        "broadcast": _broadcast,
        "expand_dims": lambda r, op, x: f"tl.expand_dims({x}, {op.attrs['axis']})",
        "trans": lambda r, op, x: f"tl.trans({x})",
        "reshape": lambda r, op, x: f"tl.reshape({x}, {tuple(op.attrs['shape'])})",
        "reduce": lambda r, op, x: f"tl.{op.attrs['kind']}({x}, axis={op.attrs['axis']})",
        "dot": _dot,
        "where": lambda r, op, c, a, b: f"tl.where({c}, {a}, {b})",
        "max": lambda r, op, a, b: f"tl.maximum({a}, {b})",
        "min": lambda r, op, a, b: f"tl.minimum({a}, {b})",
        "abs": lambda r, op, x: f"tl.abs({x})",
        "tanh": lambda r, op, x: f"(2.0 * tl.sigmoid(2.0 * {x}) - 1.0)",  # no tl.tanh in Triton 3.x
        "load": _load,
        "atomic_add": _atomic_add,
        "dot4": _dot4,
        **{m: _call(f"tl.{m}") for m in ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "erf",
                                          "floor", "ceil")},
    }

    def prologue(self, k: KernelIR) -> list[str]:
        params = ", ".join(p.name for p in k.params)
        consts = ", ".join(f"{n}={v!r}" for n, v in k.constexprs.items())
        gdc = not self.interpret and any(op.opcode in GRID_DEP for op in k.walk())
        return ["import triton  # noqa: F401", "import triton.language as tl"]  + (
            ["import triton.language.extra.cuda as tlc"] if gdc else []) + ["", "",
                f"def {k.name}({params}):", f'    """Generated from the kernel DSL; constexprs: {consts or "none"}."""']

    def render_grid_dep_wait(self, op: Op, depth: int) -> list[str]:
        return [] if self.interpret else [self.indent * depth + "tlc.gdc_wait()"]

    def render_grid_dep_launch(self, op: Op, depth: int) -> list[str]:
        return [] if self.interpret else [self.indent * depth + "tlc.gdc_launch_dependents()"]

    def render_barrier(self, op: Op, depth: int) -> list[str]:
        return [self.indent * depth + "tl.debug_barrier()"]

    def render_store(self, op: Op, depth: int) -> list[str]:
        p, v, *m = (self.name(a) for a in op.args)
        return [self.indent * depth + f"tl.store({p}, {v}" + (f", mask={m[0]}" if m else "") + ")"]

    def render_for(self, op: Op, depth: int) -> list[str]:
        pad = self.indent * depth
        lo, hi, *init = op.args
        iv, *carried = op.body.args
        self.names[iv.id] = f"i{iv.id}"
        for k, (c, r) in enumerate(zip(carried, op.results, strict=True)):
            self.names[c.id] = self.names[r.id] = f"c{op.results[0].id}_{k}"
        lines = []
        if carried:  # carried values keep one exact type across iterations, so initial constants are typed
            inits = [_typed(self, i.op) if i.op is not None and i.op.opcode == "const" else self.name(i)
                     for i in init]
            lines.append(pad + f"{', '.join(self.name(c) for c in carried)} = {', '.join(inits)}")
        bounds = f"{self.name(lo)}, {self.name(hi)}, {op.attrs['step']}"
        stages = op.attrs.get("stages")  # tl.range's pipelining (the interpreter runs it as a plain range)
        lines.append(pad + (f"for {self.name(iv)} in tl.range({bounds}, num_stages={stages}):" if stages
                            else f"for {self.name(iv)} in range({bounds}):"))
        lines += self.render_block(op.body, depth + 1)
        if carried:
            names = ", ".join(self.name(c) for c in carried)
            lines.append(pad + self.indent + f"{names} = {', '.join(self.name(y) for y in op.body.yields)}")
        return lines


def cache_dir() -> Path:
    d = os.environ.get("KERNELS_CACHE_DIR") or Path(tempfile.gettempdir()) / f"llm-engine-kernels-{os.getuid()}"
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_function(source: str, name: str):
    """The plain Python function `name` defined by `source`, imported from a file so that its source is readable."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"triton_{name}_{digest}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"_dsl_triton_{name}_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def build(source: str, name: str, interpret: bool = False):
    """A launchable Triton kernel (`fn[grid](*args, num_warps=...)`) for rendered `source`."""
    import triton

    fn = load_function(source, name)
    if interpret:
        return _Interpreted(fn)
    return triton.jit(fn)


# --- launching a compiled kernel without Triton's Python launcher -----------------------------------------------
# An eager decode step of an 8B model launches ~200 kernels; Triton's `JITFunction.run` binds and specializes every
# argument and builds its cache key in Python on each launch (tens of microseconds of host time), which is what made
# eager steps 10x slower than the GPU. Once a kernel is compiled for a specialization, the launch itself is one call
# into the CompiledKernel's C launcher: `direct_key` reproduces what Triton specializes on (pointer alignment to 16
# bytes; integers equal to 1, divisible by 16, or wider than 32 bits) so that a cached kernel is only ever reused for
# arguments Triton would have given the same binary.

def int_class(n: int) -> int:
    """direct_key's entry for an integer argument (1 | a multiple of 16 | other, and past 32 bits): what a compiled
    kernel is specialized on, so a plan keyed by it may pass any integer of the class."""
    return 1 if n == 1 else (n % 16 == 0) * 16 + (not -2**31 <= n < 2**31) * 64


def direct_key(args) -> tuple:
    """What selects a compiled binary for these launch arguments, at least as finely as Triton's own key (each
    launch computes it: written for speed)."""
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is int:  # int_class, inline
            add(1 if a == 1 else (a % 16 == 0) * 16 + (not -2**31 <= a < 2**31) * 64)
        elif t is float:
            add(2.5)
        elif t is bool:
            add(3 + a)
        elif (ptr := getattr(a, "data_ptr", None)) is not None:  # a tensor: its dtype, its address 16-byte aligned
            add(a.dtype if ptr() % 16 == 0 else (a.dtype,))
        else:  # anything else (a numpy scalar): its exact value, finer than any specialization
            add((t, a))
    return tuple(key)


def variant_key(kernel, args) -> tuple:
    """(kernel name, constexprs, (num_warps, launch_pdl, num_stages), direct_key(args)) of a launch of a DSL
    Kernel: what selects its compiled binary on a GPU. The warm-up checks (tests/test_cuda_eager_warmup.py,
    tools/check_moe_warmup.py) record launches by it."""
    return (f"{kernel.fn.__module__}.{kernel.fn.__name__}", tuple(sorted(kernel.constexprs.items())),
            (kernel.num_warps, kernel.launch_pdl, kernel.num_stages), direct_key(args))


def _hooked(hook) -> bool:
    """Whether a launch hook is set: None, or (Triton 3.5+) an empty HookChain, is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_launcher(compiled):
    """`launch(grid, args)` for a CompiledKernel that Triton's launcher returned, calling its C launcher directly;
    None when this Triton's CompiledKernel does not have the interface (the caller keeps Triton's launcher)."""
    from triton import knobs
    from triton.runtime.driver import driver

    try:
        run = compiled.run  # loads the module: `function` exists only after this
        function, metadata = compiled.function, compiled.packed_metadata
        active = driver.active
        stream_of, device = active.get_current_stream, active.get_current_device
    except AttributeError:
        return None
    runtime = knobs.runtime

    def launch(grid, args):
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return False  # a profiler's hooks (proton) expect Triton's launcher: let it launch
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream_of(device()), function, metadata,
            None, None, None, *args)
        return True

    return launch


class _Interpreted:
    """Triton's interpreter in-process, whatever TRITON_INTERPRET said when triton was imported.

    Under TRITON_INTERPRET=1 `triton.jit` makes InterpretedFunctions, also for triton.language's own jit'd
    helpers (tl.sum, tl.max, tl.sigmoid ...) at import time. Imported without it, those helpers are JITFunctions
    that refuse to run on the host, so for the duration of a launch they are swapped for interpreted twins.
    """

    def __init__(self, fn):
        from triton.runtime.interpreter import InterpretedFunction

        self.fn = InterpretedFunction(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "launch_pdl")}
            with _interpreted_stdlib():
                return self.fn[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def _interpreted_stdlib():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction

    importlib.import_module("triton.experimental.gluon")  # imported lazily by launches; it checks JITFunctions
    swapped = []
    for module in (tl, tl.standard, tl.math, tl.core):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                swapped.append((module, name, value))
    class Twin(InterpretedFunction):
        def __call__(self, *args, **kwargs):  # upstream leaves triton.language patched after a device call
            scope = _patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            finally:
                scope.restore()

    twins = {id(v): Twin(v.fn) for _, _, v in swapped}
    import triton.runtime.interpreter as interp

    patch_tensor = interp._patch_lang_tensor

    def patch_index(tensor, scope):  # Triton 3.6 calls int() on a one-element array, which numpy 2 refuses
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    try:
        interp._patch_lang_tensor = patch_index
        for module, name, value in swapped:
            setattr(module, name, twins[id(value)])
        yield
    finally:
        interp._patch_lang_tensor = patch_tensor
        for module, name, value in swapped:
            setattr(module, name, value)


def aot_compile(k: KernelIR, arch: int = 90, num_warps: int = 4, num_stages: int = 3, aligned: bool = False):
    """Compile for CUDA sm_`arch` without a GPU (ptxas ships in the triton wheel); returns triton's CompiledKernel
    whose `.asm` holds ttir, ttgir, llir, ptx and cubin. `aligned`: every parameter divisible by 16, as the JIT
    specializes pointers and sizes that are (what vectorized loads need)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if triton.knobs.runtime.interpret:
        raise RuntimeError("AOT builds need TRITON_INTERPRET unset: under it triton.language's helpers are "
                           "interpreted functions that the compiler cannot lower")
    # JITFunction, not triton.jit: under TRITON_INTERPRET=1 the latter makes an interpreted function
    fn = JITFunction(load_function(TritonRenderer().render(k), k.name))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(k.params))} if aligned else None
    src = ASTSource(fn, signature=k.signature, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
