"""The kernel IR: typed SSA values with static tile shapes, in blocks (the kernel body and loop bodies).

One kernel is one program of a grid. Every value is a tile of a static shape (`()` is a scalar, uniform across
the program) and a dtype or pointer type. Elementwise ops take operands of one dtype whose shapes are either the
result shape or `()`; any other broadcast is an explicit `broadcast` op. Loops are `for` ops whose body block takes
the induction variable and the loop-carried values as block arguments and ends in `yields`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # Triton's signature spelling: fp32, i32, u8, i1 ...
    kind: str  # "f" float, "i" signed, "u" unsigned, "b" bool
    bits: int

    def __str__(self) -> str:
        return self.name

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @property
    def np(self) -> np.dtype:
        """The numpy dtype the interpreter computes in (bf16 is held as fp32, rounded; fp8e4nv as its bytes)."""
        return np.dtype(_NP_NAMES[self.name])


@dataclass(frozen=True)
class PtrType:
    elem: DType

    @property
    def element_ty(self) -> DType:  # Triton's spelling, so kernels read alike
        return self.elem

    def __str__(self) -> str:
        return f"*{self.elem}"


_TABLE = [("i1", "b", 1), ("i8", "i", 8), ("i16", "i", 16), ("i32", "i", 32), ("i64", "i", 64),
          ("u8", "u", 8), ("u16", "u", 16), ("u32", "u", 32), ("u64", "u", 64),
          ("fp16", "f", 16), ("bf16", "f", 16), ("fp32", "f", 32), ("fp64", "f", 64), ("fp8e4nv", "f", 8)]
DTYPES: dict[str, DType] = {n: DType(n, k, b) for n, k, b in _TABLE}
_NP_NAMES = {"i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
             "u16": "uint16", "u32": "uint32", "u64": "uint64", "fp16": "float16", "bf16": "float32",
             "fp32": "float32", "fp64": "float64", "fp8e4nv": "uint8"}
# numpy / torch / mlx dtype names (the part after the last dot) to ours
FOREIGN_NAMES = {v: DTYPES[k] for k, v in _NP_NAMES.items() if k not in ("bf16", "fp8e4nv")} | {
    "bfloat16": DTYPES["bf16"], "half": DTYPES["fp16"], "float": DTYPES["fp32"], "double": DTYPES["fp64"],
    "int": DTYPES["i32"], "long": DTYPES["i64"]}
bool_, fp16, bf16, fp32, i32, i64 = (DTYPES[n] for n in ("i1", "fp16", "bf16", "fp32", "i32", "i64"))
# fp8e4nv: OCP FP8 e4m3 ("fn": no infinities, 0x7F / 0xFF NaN). A tile of it exists only between a bitcast from 8-bit
# integers and a conversion to fp16 / bf16 / fp32 (tile.py refuses the rest): on sm_89+ Triton converts two bytes in
# one instruction (cvt.rn.f16x2.e4m3x2); targets without FP8 refuse it (fp8_free).
fp8e4nv = DTYPES["fp8e4nv"]
FP8_WIDENS_TO = frozenset({"fp16", "bf16", "fp32"})


def dtype_of(x) -> DType:
    """Our dtype for a DType, a name of ours, or a numpy/torch/mlx dtype."""
    if isinstance(x, DType):
        return x
    s = str(x)
    if s in DTYPES:
        return DTYPES[s]
    s = s.rsplit(".", 1)[-1]
    if s not in FOREIGN_NAMES:
        raise TypeError(f"unsupported dtype {x!r}")
    return FOREIGN_NAMES[s]


@dataclass(frozen=True)
class TileType:
    dtype: DType | PtrType
    shape: tuple[int, ...] = ()

    @property
    def is_ptr(self) -> bool:
        return isinstance(self.dtype, PtrType)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]" if self.shape else str(self.dtype)


# --- opcodes ------------------------------------------------------------------------------------------------
# Math ops require fp32 (Triton's rule); cast half inputs first.
MATH = frozenset({"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "erf", "floor", "ceil"})
UNARY = MATH | {"neg", "not", "abs"}  # "not" is bitwise on ints, logical on i1
# div: true division of floats. idiv/mod: integers, C semantics (truncate toward zero; remainder has the sign
# of the dividend). shr: arithmetic on signed, logical on unsigned.
BINARY = frozenset({"add", "sub", "mul", "div", "idiv", "mod", "max", "min", "and", "or", "xor", "shl", "shr"})
COMPARE = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})  # result i1
# dot4: acc (i32) + the 4-way dot product of the bytes of two 32-bit words (attrs signed_a, signed_b: each word's
# bytes as int8 or uint8), wrapping in 32 bits; PTX's dp4a.
ELEMENTWISE = UNARY | BINARY | COMPARE | {"where", "cast", "bitcast", "dot4"}
# grid_dep_wait / grid_dep_launch: programmatic dependent launch (a kernel launched with launch_pdl may start
# while the kernel before it runs; `grid_dep_wait` blocks until that one finished and its writes are visible,
# `grid_dep_launch` lets the next kernel start early). No results; no-ops wherever kernels run one after another.
GRID_DEP = frozenset({"grid_dep_wait", "grid_dep_launch"})
# atomic_add(ptr, value[, mask]) -> the old value: scalars only (one program, one address), attrs sem ("acq_rel",
# "acquire", "release", "relaxed") and scope ("gpu", "cta", "sys") as Triton's; masked off, it does nothing and its
# result is undefined. barrier: every thread of the program reaches it before any goes on, its earlier writes seen
# by the others (Triton's debug_barrier, CUDA's __syncthreads). Targets without atomics refuse them (atomics_free).
ATOMICS = frozenset({"atomic_add"})
SEMANTICS = ("acq_rel", "acquire", "release", "relaxed")
SCOPES = ("gpu", "cta", "sys")
# Others: const, param, program_id, num_programs, arange, broadcast, expand_dims, reshape (row-major, attr shape),
# trans, reduce, dot, ptr_add, ptr_cast, load, store, barrier, for.
REDUCE_KINDS = ("sum", "max", "min")


class Value:
    """One SSA value: the result of `op` (None for block arguments and kernel parameters)."""

    __slots__ = ("id", "type", "op", "block", "name")

    def __init__(self, id: int, type: TileType, op: Op | None, block: Block | None, name: str | None = None):
        self.id, self.type, self.op, self.block, self.name = id, type, op, block, name

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    def __repr__(self) -> str:
        return f"%{self.name or self.id}"


@dataclass(eq=False)
class Op:
    opcode: str
    args: tuple[Value, ...]
    attrs: dict
    results: list[Value] = field(default_factory=list)
    body: Block | None = None  # the loop body of a `for`

    @property
    def result(self) -> Value:
        return self.results[0]


@dataclass(eq=False)
class Block:
    parent: Block | None
    args: list[Value] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    yields: list[Value] = field(default_factory=list)

    def encloses(self, other: Block | None) -> bool:
        """True when values of `self` are visible in `other` (same block or a block nested inside)."""
        while other is not None:
            if other is self:
                return True
            other = other.parent
        return False


@dataclass(eq=False)
class KernelIR:
    name: str
    params: list[Value]  # runtime parameters in call order: pointers and scalars, each with .name
    body: Block
    constexprs: dict

    @property
    def signature(self) -> dict[str, str]:
        """Triton-style signature strings: "*fp16", "i32", "fp32"."""
        return {p.name: str(p.dtype) for p in self.params}

    @property
    def grid_rank(self) -> int:
        axes = [op.attrs["axis"] for op in self.walk() if op.opcode in ("program_id", "num_programs")]
        return max(axes, default=0) + 1

    def walk(self, block: Block | None = None):
        """All ops in program order, loop bodies included."""
        for op in (block or self.body).ops:
            yield op
            if op.body is not None:
                yield from self.walk(op.body)


def fp8_free(k: KernelIR, target: str) -> None:
    """ValueError when kernel `k` holds fp8e4nv values: `target` has no FP8 type (decode e4m3 bytes with integer ops,
    kernels_src/e4m3.py, there)."""
    for op in k.walk():
        if any(v.dtype == fp8e4nv for v in (*op.args, *op.results)):
            raise ValueError(f"kernel {k.name}: target {target!r} has no FP8 type (op {op.opcode} on fp8e4nv); decode "
                             "e4m3 bytes with kernels_src.e4m3's integer path on it")


def atomics_free(k: KernelIR, target: str) -> None:
    """ValueError when kernel `k` holds atomics: `target` (the SIMT ones: C, CUDA C, Metal) does not lower them
    (a kernel that needs one keeps a form without, chosen by its launcher for such targets)."""
    for op in k.walk():
        if op.opcode in ATOMICS:
            raise ValueError(f"kernel {k.name}: target {target!r} does not support atomics (op {op.opcode}); launch "
                             "the form without them there")
