"""Tracing: run a kernel function once on symbolic tiles and record the ops it makes as a KernelIR."""

from __future__ import annotations

import inspect

from .ir import Block, DType, KernelIR, Op, PtrType, TileType, Value, dtype_of


class TraceError(Exception):
    pass


class Builder:
    """Appends ops to the innermost open block; checks that operands are visible there (SSA dominance)."""

    def __init__(self):
        self.count = 0
        self.root = Block(None)
        self.block = self.root

    def value(self, type: TileType, block: Block, op: Op | None = None, name: str | None = None) -> Value:
        self.count += 1
        return Value(self.count - 1, type, op, block, name)

    def emit(self, opcode: str, args, attrs: dict | None = None, types=()) -> Op:
        for a in args:
            if not a.block.encloses(self.block):
                raise TraceError(f"{opcode}: operand {a} was made inside a loop body and used outside it "
                                 "(return it from the body as a loop-carried value)")
        op = Op(opcode, tuple(args), dict(attrs or {}))
        op.results = [self.value(t, self.block, op) for t in types]
        self.block.ops.append(op)
        return op


_stack: list[Builder] = []


def current() -> Builder:
    if not _stack:
        raise TraceError("DSL call outside a trace: kernels run through dsl.compile(...) or dsl.trace(...)")
    return _stack[-1]


def is_constexpr(annotation) -> bool:
    from .tile import constexpr

    if annotation is constexpr:
        return True
    return isinstance(annotation, str) and annotation.rsplit(".", 1)[-1] == "constexpr"


def parse_type(t) -> DType | PtrType:
    """"*fp16" (a pointer), "i32", a DType, a PtrType, or a numpy/torch dtype."""
    if isinstance(t, DType | PtrType):
        return t
    if isinstance(t, str) and t.startswith("*"):
        return PtrType(dtype_of(t[1:]))
    return dtype_of(t)


def split_params(fn) -> tuple[list[str], list[str]]:
    """(runtime parameter names, constexpr parameter names) in declaration order."""
    runtime, const = [], []
    for p in inspect.signature(fn).parameters.values():
        (const if is_constexpr(p.annotation) else runtime).append(p.name)
    return runtime, const


def trace(fn, signature: dict, constexprs: dict | None = None) -> KernelIR:
    """KernelIR of `fn` for runtime parameter types `signature` ({name: "*fp32" | "i32" | ...}) and constexprs."""
    from .tile import Tile

    constexprs = dict(constexprs or {})
    params = inspect.signature(fn).parameters
    runtime, const = split_params(fn)
    for name in const:
        if name not in constexprs:
            default = params[name].default
            if default is inspect.Parameter.empty:
                raise TraceError(f"{fn.__name__}: constexpr {name} not given")
            constexprs[name] = default
    unknown = set(constexprs) - set(const)
    if unknown:
        raise TraceError(f"{fn.__name__}: {sorted(unknown)} are not constexpr parameters")
    missing = [n for n in runtime if n not in signature]
    if missing:
        raise TraceError(f"{fn.__name__}: no type for parameters {missing}")
    b = Builder()
    values = [b.value(TileType(parse_type(signature[n])), b.root, name=n) for n in runtime]
    kwargs = {n: Tile(v) for n, v in zip(runtime, values, strict=True)} | {n: constexprs[n] for n in const}
    _stack.append(b)
    try:
        out = fn(**kwargs)
    finally:
        _stack.pop()
    if out is not None:
        raise TraceError(f"{fn.__name__}: kernels return nothing; write results with tl.store")
    return KernelIR(fn.__name__, values, b.root, {n: constexprs[n] for n in const})
