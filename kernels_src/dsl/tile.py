"""Tiles: the traced values of the kernel language, their operators, typing and broadcasting rules."""

from __future__ import annotations

import numpy as np

from . import ir
from .ir import DTYPES, MATH, DType, PtrType, TileType, Value
from .tracer import TraceError, current

int1, int8, int16, int32, int64 = (DTYPES[n] for n in ("i1", "i8", "i16", "i32", "i64"))
uint8, uint16, uint32, uint64 = (DTYPES[n] for n in ("u8", "u16", "u32", "u64"))
float16, bfloat16, float32, float64 = (DTYPES[n] for n in ("fp16", "bf16", "fp32", "fp64"))
float8e4nv = DTYPES["fp8e4nv"]  # Triton's name for OCP e4m3fn (see ir.fp8e4nv)
# what an fp8e4nv tile may go through: its bitcast in (or a load through an fp8 pointer, `other` 0 for masked
# elements), its conversion out, moves of its registers, and a dot with another (tl.dot checks the pair)
_FP8_OPS = frozenset({"cast", "bitcast", "expand_dims", "broadcast", "reshape", "trans", "dot", "load"})


class constexpr:
    """Annotation of a compile-time parameter: `BLOCK: tl.constexpr`. Its value is a plain Python value."""


def pointer_type(elem: DType) -> PtrType:
    return PtrType(elem)


class Tile:
    """A traced value: a tile of a static shape (or a scalar, shape ()) of a dtype or pointer type."""

    __slots__ = ("v",)
    __hash__ = object.__hash__

    def __init__(self, v: Value):
        self.v = v

    dtype = property(lambda self: self.v.dtype)
    shape = property(lambda self: self.v.shape)
    type = property(lambda self: self.v.type)

    def __repr__(self) -> str:
        return f"Tile({self.v!r}: {self.type})"

    def __bool__(self):
        raise TraceError("a traced value has no truth value: use tl.where / masks, or a constexpr for Python `if`")

    def __iter__(self):
        raise TraceError("a traced value is not iterable: use tl.static_range or tl.fori_loop")

    def to(self, dtype, bitcast: bool = False) -> Tile:
        if isinstance(dtype, PtrType):
            if not isinstance(self.dtype, PtrType):
                raise TraceError(f"cannot cast {self.type} to a pointer")
            return _op("ptr_cast", [self], TileType(dtype, self.shape))
        dtype = ir.dtype_of(dtype)
        if bitcast:
            if self.dtype.bits != dtype.bits:
                raise TraceError(f"bitcast {self.dtype} -> {dtype} changes the width")
            return self if self.dtype == dtype else _op("bitcast", [self], TileType(dtype, self.shape))
        return _cast(self, dtype)

    def __getitem__(self, idx) -> Tile:
        """`x[:, None]` inserts an axis of 1; only `:` and `None` are allowed."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        out, axis = self, 0
        for i in idx:
            if i is None:
                out = expand_dims(out, axis)
            elif not (isinstance(i, slice) and i == slice(None)):
                raise TraceError("tiles are indexed only with ':' and None")
            axis += 1
        return out

    __add__ = lambda a, b: _binary("add", a, b)
    __radd__ = lambda a, b: _binary("add", b, a)
    __sub__ = lambda a, b: _binary("sub", a, b)
    __rsub__ = lambda a, b: _binary("sub", b, a)
    __mul__ = lambda a, b: _binary("mul", a, b)
    __rmul__ = lambda a, b: _binary("mul", b, a)
    __truediv__ = lambda a, b: _binary("div", a, b)
    __rtruediv__ = lambda a, b: _binary("div", b, a)
    __floordiv__ = lambda a, b: _binary("idiv", a, b)
    __rfloordiv__ = lambda a, b: _binary("idiv", b, a)
    __mod__ = lambda a, b: _binary("mod", a, b)
    __rmod__ = lambda a, b: _binary("mod", b, a)
    __and__ = lambda a, b: _binary("and", a, b)
    __rand__ = lambda a, b: _binary("and", b, a)
    __or__ = lambda a, b: _binary("or", a, b)
    __ror__ = lambda a, b: _binary("or", b, a)
    __xor__ = lambda a, b: _binary("xor", a, b)
    __rxor__ = lambda a, b: _binary("xor", b, a)
    __lshift__ = lambda a, b: _binary("shl", a, b)
    __rlshift__ = lambda a, b: _binary("shl", b, a)
    __rshift__ = lambda a, b: _binary("shr", a, b)
    __rrshift__ = lambda a, b: _binary("shr", b, a)
    __lt__ = lambda a, b: _binary("lt", a, b)
    __le__ = lambda a, b: _binary("le", a, b)
    __gt__ = lambda a, b: _binary("gt", a, b)
    __ge__ = lambda a, b: _binary("ge", a, b)
    __eq__ = lambda a, b: _binary("eq", a, b)
    __ne__ = lambda a, b: _binary("ne", a, b)
    __neg__ = lambda a: _op("neg", [a], a.type)
    __invert__ = lambda a: _unary("not", a)


# --- helpers -------------------------------------------------------------------------------------------------

def _op(opcode: str, args, type: TileType, **attrs) -> Tile:
    if opcode not in _FP8_OPS and any(a.dtype == float8e4nv for a in args):
        raise TraceError(f"{opcode} on an fp8e4nv tile: fp8 tiles only convert to fp16, bf16 or fp32 first")
    return Tile(current().emit(opcode, [a.v for a in args], attrs, [type]).result)


def _const(value, dtype: DType) -> Tile:
    value = bool(value) if dtype.kind == "b" else int(value) if dtype.is_int else float(value)
    return _op("const", [], TileType(dtype), value=value)


def _lift(x, like: DType | PtrType | None = None) -> Tile:
    """A Tile for `x`; Python numbers take the dtype of the other operand where it fits (Triton's weak typing)."""
    if isinstance(x, Tile):
        return x
    if isinstance(x, np.generic):
        return _const(x.item(), ir.dtype_of(x.dtype))
    if isinstance(like, PtrType):
        like = None
    if isinstance(x, bool):
        return _const(x, int1)
    if isinstance(x, int):
        if like is not None and like.kind in "iuf":
            return _const(x, like)
        return _const(x, int32 if -2**31 <= x < 2**31 else int64)
    if isinstance(x, float):
        return _const(x, like if like is not None and like.is_float else float32)
    raise TraceError(f"cannot use {type(x).__name__} {x!r} in a kernel")


def _promote(a: DType, b: DType) -> DType:
    if a == b:
        return a
    rank = {"b": 0, "u": 1, "i": 1, "f": 2}
    if rank[a.kind] != rank[b.kind]:
        return a if rank[a.kind] > rank[b.kind] else b
    if a.is_float and a.bits == b.bits:  # fp16 with bf16
        return float32
    if a.bits != b.bits:
        return a if a.bits > b.bits else b
    return a if a.kind == "u" else b  # same width, mixed sign: unsigned, as in C


def _cast(t: Tile, dtype: DType) -> Tile:
    if isinstance(t.dtype, PtrType):
        raise TraceError(f"cannot convert pointer {t.type} to {dtype}")
    if t.dtype != dtype and float8e4nv in (t.dtype, dtype) and (
            dtype == float8e4nv or dtype.name not in ir.FP8_WIDENS_TO):
        raise TraceError(f"cannot convert {t.dtype} to {dtype}: fp8e4nv tiles come from bitcasts of 8-bit integers "
                         "(kernels_src/e4m3.py encodes) and convert to fp16, bf16 or fp32")
    return t if t.dtype == dtype else _op("cast", [t], TileType(dtype, t.shape), to=dtype)


def _common_shape(*tiles: Tile) -> tuple[int, ...]:
    shapes = [t.shape for t in tiles if t.shape]
    try:
        return tuple(np.broadcast_shapes(*shapes)) if shapes else ()
    except ValueError:
        raise TraceError(f"shapes {shapes} do not broadcast") from None


def _to_shape(t: Tile, shape: tuple[int, ...]) -> Tile:
    """Scalars stay scalars (uniform); other tiles get explicit expand_dims/broadcast to `shape`."""
    if not t.shape or t.shape == shape:
        return t
    while len(t.shape) < len(shape):
        t = expand_dims(t, 0)
    return t if t.shape == shape else _op("broadcast", [t], TileType(t.dtype, shape), shape=shape)


def _elementwise(opcode: str, args: list[Tile], dtype: DType, **attrs) -> Tile:
    shape = _common_shape(*args)
    return _op(opcode, [_to_shape(a, shape) for a in args], TileType(dtype, shape), **attrs)


def _binary(opcode: str, a, b) -> Tile:
    a_like = a.dtype if isinstance(a, Tile) else None
    b_like = b.dtype if isinstance(b, Tile) else None
    a, b = _lift(a, b_like), _lift(b, a_like)
    if isinstance(a.dtype, PtrType) or isinstance(b.dtype, PtrType):
        return _ptr_arith(opcode, a, b)
    if opcode in ("shl", "shr"):
        if not (a.dtype.is_int and b.dtype.is_int):
            raise TraceError(f"{opcode} needs integers, got {a.dtype} and {b.dtype}")
        return _elementwise(opcode, [a, _cast(b, a.dtype)], a.dtype)
    dtype = _promote(a.dtype, b.dtype)
    if opcode == "div" and not dtype.is_float:
        dtype = float32
    if opcode in ("idiv", "mod") and not dtype.is_int:
        raise TraceError(f"{opcode} is for integers (got {dtype}); use / and tl.floor for floats")
    if opcode in ("and", "or", "xor") and dtype.is_float:
        raise TraceError(f"{opcode} needs integers or booleans, got {dtype}")
    out = int1 if opcode in ir.COMPARE else dtype
    return _elementwise(opcode, [_cast(a, dtype), _cast(b, dtype)], out)


def _ptr_arith(opcode: str, a: Tile, b: Tile) -> Tile:
    if opcode == "add" and isinstance(b.dtype, PtrType):
        a, b = b, a
    if opcode not in ("add", "sub") or isinstance(b.dtype, PtrType) or not b.dtype.is_int:
        raise TraceError(f"pointer arithmetic is ptr + int or ptr - int, not {opcode} {a.type}, {b.type}")
    if b.dtype not in (int32, int64):
        b = _cast(b, int64 if b.dtype.bits > 32 or b.dtype == DTYPES["u32"] else int32)
    if opcode == "sub":
        b = -b
    return _elementwise("ptr_add", [a, b], a.dtype)


def _unary(opcode: str, x) -> Tile:
    x = _lift(x)
    if opcode in MATH and x.dtype != float32:
        raise TraceError(f"{opcode} needs fp32, got {x.dtype}: cast with .to(tl.float32) first")
    if opcode == "not" and x.dtype.is_float:
        raise TraceError(f"~ needs integers or booleans, got {x.dtype}")
    return _op(opcode, [x], x.type)


def _axis(x: Tile, axis: int) -> int:
    if not -len(x.shape) <= axis < len(x.shape):
        raise TraceError(f"axis {axis} out of range for {x.type}")
    return axis % len(x.shape)


def _pow2(shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if any(s < 1 or s & (s - 1) for s in shape):
        raise TraceError(f"tile dims must be powers of two, got {shape}")
    return shape


def expand_dims(x: Tile, axis: int) -> Tile:
    x = _lift(x)
    axis = axis % (len(x.shape) + 1)
    return _op("expand_dims", [x], TileType(x.dtype, x.shape[:axis] + (1,) + x.shape[axis:]), axis=axis)
