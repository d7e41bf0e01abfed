"""The renderer base: walks a KernelIR, names its SSA values and spells each op from the subclass's tables.

A target is a subclass that mostly sets attributes (tinygrad-style): its dtype names, its infix operators, its
spelling of each op (`code_for_op`: opcode -> function of (renderer, op, *operand names) giving an expression),
how a statement ends and how a value is declared. Structural ops (`for`, `store`) have overridable methods.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .ir import Block, DType, KernelIR, Op, PtrType, Value


class Renderer:
    target = "base"
    indent = "    "
    stmt_end = ""  # ";" in C-like targets
    dtype_names: dict[str, str] = {}
    infix: dict[str, str] = {
        "add": "+", "sub": "-", "mul": "*", "div": "/", "and": "&", "or": "|", "xor": "^", "shl": "<<",
        "shr": ">>", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
    }
    prefix: dict[str, str] = {"neg": "-", "not": "~"}
    code_for_op: dict[str, Callable[..., str]] = {}
    true, false = "True", "False"
    inf, nan = 'float("inf")', 'float("nan")'

    # --- naming and literals ------------------------------------------------------------------------------

    def name(self, v: Value) -> str:
        return self.names.get(v.id) or v.name or f"v{v.id}"

    def dtype(self, t: DType | PtrType) -> str:
        if isinstance(t, PtrType):
            return self.ptr_type(self.dtype(t.elem))
        return self.dtype_names[t.name]

    def ptr_type(self, elem: str) -> str:
        return f"{elem}*"

    def literal(self, value, dtype: DType) -> str:
        if dtype.kind == "b":
            return self.true if value else self.false
        if dtype.is_int:
            return str(int(value))
        if math.isnan(value):
            return self.nan
        if math.isinf(value):
            return self.inf if value > 0 else f"-{self.inf}"
        return repr(float(value))

    # --- statements ---------------------------------------------------------------------------------------

    def assign(self, v: Value, expr: str) -> str:
        """The statement that binds `v` (a declaration in C-like targets)."""
        return f"{self.name(v)} = {expr}{self.stmt_end}"

    def expr(self, op: Op) -> str:
        args = [self.name(a) for a in op.args]
        if op.opcode in self.code_for_op:
            return self.code_for_op[op.opcode](self, op, *args)
        if op.opcode in self.infix:
            return f"({args[0]} {self.infix[op.opcode]} {args[1]})"
        if op.opcode in self.prefix:
            return f"({self.prefix[op.opcode]}{args[0]})"
        raise NotImplementedError(f"{self.target}: no spelling for {op.opcode}")

    def render_op(self, op: Op, depth: int) -> list[str]:
        method = getattr(self, f"render_{op.opcode}", None)
        if method is not None:
            return method(op, depth)
        return [self.indent * depth + self.assign(op.result, self.expr(op))]

    def render_block(self, block: Block, depth: int) -> list[str]:
        lines = [line for op in block.ops for line in self.render_op(op, depth)]
        return lines or [self.indent * depth + self.empty_body]

    empty_body = "pass"

    # --- the kernel ---------------------------------------------------------------------------------------

    def prologue(self, k: KernelIR) -> list[str]:
        raise NotImplementedError

    def epilogue(self, k: KernelIR) -> list[str]:
        return []

    def render(self, k: KernelIR) -> str:
        self.names: dict[int, str] = {}
        return "\n".join(self.prologue(k) + self.render_block(k.body, 1) + self.epilogue(k)) + "\n"
