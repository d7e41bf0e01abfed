"""The kernel language, used as `from kernels_src.dsl import tl`: Triton's tile vocabulary, traced into kernel IR."""

from __future__ import annotations

import builtins

import numpy as np

from .ir import SCOPES, SEMANTICS, PtrType, TileType
from .tile import (  # noqa: F401  (re-exported names of the language)
    Tile,
    _axis,
    _binary,
    _cast,
    _common_shape,
    _const,
    _elementwise,
    _lift,
    _op,
    _pow2,
    _promote,
    _to_shape,
    _unary,
    bfloat16,
    constexpr,
    expand_dims,
    float8e4nv,
    float16,
    float32,
    float64,
    int1,
    int8,
    int16,
    int32,
    int64,
    pointer_type,
    uint8,
    uint16,
    uint32,
    uint64,
)
from .tracer import TraceError, current

# --- program indexing and tile creation ------------------------------------------------------------------------


def program_id(axis: int) -> Tile:
    return _op("program_id", [], TileType(int32), axis=int(axis))


def num_programs(axis: int) -> Tile:
    return _op("num_programs", [], TileType(int32), axis=int(axis))


def arange(start: int, end: int) -> Tile:
    """i32 [end - start] holding start, start+1, ...; start and end are constexprs."""
    start, end = int(start), int(end)
    return _op("arange", [], TileType(int32, _pow2([end - start])), start=start, end=end)


def full(shape, value, dtype) -> Tile:
    shape = _pow2(shape)
    v = _cast(_lift(value), dtype) if isinstance(value, Tile) else _const(value, dtype)
    return _to_shape(v, shape) if not shape else _op("broadcast", [v], TileType(dtype, shape), shape=shape)


def zeros(shape, dtype) -> Tile:
    return full(shape, 0, dtype)


def cast(x, dtype, bitcast: bool = False) -> Tile:
    return _lift(x).to(dtype, bitcast=bitcast)


def broadcast_to(x, shape) -> Tile:
    x, shape = _lift(x), tuple(shape)
    if not x.shape:
        return full(shape, x, x.dtype)
    try:
        ok = np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise TraceError(f"cannot broadcast {x.type} to {shape}")
    return _to_shape(x, shape)


def reshape(x, shape) -> Tile:
    """The same elements in row-major order under a new shape of as many elements (powers of two, as every tile).
    Registers keep their elements: every target's layouts map bits of the row-major flat index, which this keeps."""
    x, shape = _lift(x), _pow2(shape)
    if TileType(x.dtype, shape).numel != TileType(x.dtype, x.shape).numel or not x.shape:
        raise TraceError(f"cannot reshape {x.type} to {list(shape)}: the element counts differ")
    return x if shape == x.shape else _op("reshape", [x], TileType(x.dtype, shape), shape=shape)


def trans(x: Tile) -> Tile:
    if len(x.shape) != 2:
        raise TraceError(f"trans needs a 2-d tile, got {x.type}")
    return _op("trans", [x], TileType(x.dtype, x.shape[::-1]))


# --- memory ----------------------------------------------------------------------------------------------------


def _check_ptr(ptr, what: str) -> Tile:
    if not (isinstance(ptr, Tile) and isinstance(ptr.dtype, PtrType)):
        raise TraceError(f"{what} needs a pointer (a pointer parameter plus offsets), got {ptr!r}")
    return ptr


def _check_mask(mask) -> Tile:
    mask = _lift(mask)
    if mask.dtype != int1:
        raise TraceError(f"masks are booleans (comparisons), got {mask.dtype}")
    return mask


def _ptr_to(ptr: Tile, shape: tuple[int, ...]) -> Tile:
    """Pointers take the access shape (masks, values and `other` may stay scalars)."""
    if ptr.shape == shape or ptr.shape:
        return _to_shape(ptr, shape)
    return _op("broadcast", [ptr], TileType(ptr.dtype, shape), shape=shape)


def load(ptr: Tile, mask=None, other=None) -> Tile:
    """Elements at `ptr`; where `mask` is False, `other` (undefined without it: the interpreter returns poison)."""
    ptr = _check_ptr(ptr, "load")
    args = [ptr]
    if mask is not None:
        args.append(_check_mask(mask))
        if other is not None:
            args.append(_cast(_lift(other, ptr.dtype.elem), ptr.dtype.elem))
    shape = _common_shape(*args)
    args = [_ptr_to(ptr, shape)] + [_to_shape(a, shape) for a in args[1:]]
    return _op("load", args, TileType(ptr.dtype.elem, shape))


def store(ptr: Tile, value, mask=None) -> None:
    """Write `value` (converted to the pointer's element type) at `ptr` where `mask` is True."""
    ptr = _check_ptr(ptr, "store")
    args = [ptr, _cast(_lift(value, ptr.dtype.elem), ptr.dtype.elem)]
    if mask is not None:
        args.append(_check_mask(mask))
    shape = _common_shape(*args)
    args = [_ptr_to(ptr, shape)] + [_to_shape(a, shape) for a in args[1:]]
    current().emit("store", [a.v for a in args], {}, [])


def wait_prior_grid() -> None:
    """Block until the kernel launched before this one has finished and its writes are visible (for kernels
    launched with `launch_pdl`, which may start early: loads that need no such writes can be issued before)."""
    current().emit("grid_dep_wait", [], {}, [])


def launch_dependents() -> None:
    """Let a kernel launched after this one with `launch_pdl` start now (it waits with wait_prior_grid)."""
    current().emit("grid_dep_launch", [], {}, [])


def atomic_add(ptr: Tile, val, mask=None, sem: str = "acq_rel", scope: str = "gpu") -> Tile:
    """Add `val` at the scalar pointer `ptr` atomically (`sem`, `scope` as Triton's) and return the value before.
    One per program, not per element: a release orders only this thread's writes, so a program whose threads all
    wrote calls debug_barrier() first (and after, before its threads read what an acquire made visible)."""
    ptr = _check_ptr(ptr, "atomic_add")
    elem = ptr.dtype.elem
    if ptr.shape or (isinstance(val, Tile) and val.shape) or (mask is not None and _lift(mask).shape):
        raise TraceError("atomic_add takes a scalar pointer, value and mask (one atomic a program)")
    if not (elem.is_int and elem.bits in (32, 64)) and elem.name != "fp32":
        raise TraceError(f"atomic_add on {elem}: 32- or 64-bit integers or fp32")
    if sem not in SEMANTICS or scope not in SCOPES:
        raise TraceError(f"atomic_add sem {sem!r} / scope {scope!r}: one of {SEMANTICS} / {SCOPES}")
    args = [ptr, _cast(_lift(val, elem), elem)] + ([] if mask is None else [_check_mask(mask)])
    return _op("atomic_add", args, TileType(elem), sem=sem, scope=scope)


def debug_barrier() -> None:
    """Every thread of the program waits here for the others; their writes before it are seen after it."""
    current().emit("barrier", [], {}, [])


# --- elementwise math ------------------------------------------------------------------------------------------


def where(cond, a, b) -> Tile:
    cond = _check_mask(cond)
    a_like = a.dtype if isinstance(a, Tile) else None
    b_like = b.dtype if isinstance(b, Tile) else None
    a, b = _lift(a, b_like), _lift(b, a_like)
    dtype = _promote(a.dtype, b.dtype)
    return _elementwise("where", [cond, _cast(a, dtype), _cast(b, dtype)], dtype)


def maximum(a, b) -> Tile:
    return _binary("max", a, b)


def minimum(a, b) -> Tile:
    return _binary("min", a, b)


def abs(x) -> Tile:
    return _unary("abs", x)


def _math(name: str):
    f = lambda x: _unary(name, x)
    f.__name__ = name
    f.__doc__ = f"Elementwise {name} of an fp32 tile."
    return f


exp, exp2, log, log2, sqrt, rsqrt = (_math(n) for n in ("exp", "exp2", "log", "log2", "sqrt", "rsqrt"))
sin, cos, tanh, erf, floor, ceil = (_math(n) for n in ("sin", "cos", "tanh", "erf", "floor", "ceil"))


def dot4(a, b, acc, signed_a: bool = False, signed_b: bool = True) -> Tile:
    """acc + sum_k byte_k(a) * byte_k(b) over the 4 bytes of 32-bit integer words a and b, bytes read as uint8 or
    int8 (`signed_a`, `signed_b`); i32, wrapping. One dp4a instruction on NVIDIA GPUs, 4 multiply-adds elsewhere."""
    a, b = _lift(a, uint32), _lift(b, uint32)
    if not (a.dtype.is_int and a.dtype.bits == 32 and b.dtype.is_int and b.dtype.bits == 32):
        raise TraceError(f"dot4 takes 32-bit integer words, got {a.dtype} and {b.dtype}")
    acc = _cast(_lift(acc, int32), int32)
    return _elementwise("dot4", [a.to(uint32, bitcast=True), b.to(uint32, bitcast=True), acc], int32,
                        signed_a=bool(signed_a), signed_b=bool(signed_b))


def sigmoid(x) -> Tile:
    return 1.0 / (1.0 + exp(-_lift(x)))


# --- reductions and dot ----------------------------------------------------------------------------------------


def _reduce(kind: str, x, axis, keep_dims: bool) -> Tile:
    x = _lift(x)
    if axis is None:
        for _ in range(len(x.shape)):
            x = _reduce(kind, x, 0, False)
        return x
    axis = _axis(x, axis)
    if x.dtype.bits < 32:  # reductions run in 32 bits at least (Triton widens these itself)
        x = _cast(x, float32 if x.dtype.is_float else int32)
    out = _op("reduce", [x], TileType(x.dtype, x.shape[:axis] + x.shape[axis + 1:]), kind=kind, axis=axis)
    return expand_dims(out, axis) if keep_dims else out


def sum(x, axis=None, keep_dims: bool = False) -> Tile:
    return _reduce("sum", x, axis, keep_dims)


def max(x, axis=None, keep_dims: bool = False) -> Tile:
    return _reduce("max", x, axis, keep_dims)


def min(x, axis=None, keep_dims: bool = False) -> Tile:
    return _reduce("min", x, axis, keep_dims)


def dot(a: Tile, b: Tile, acc: Tile | None = None) -> Tile:
    """[M, K] @ [K, N] -> fp32 [M, N], every dim >= 16 (Triton's tensor-core minimum); fp32 inputs in full IEEE.
    int8 @ int8 -> int32 [M, N] (exact, wrapping past 2**31), K >= 32 (the int8 MMA's K). float8e4nv @ float8e4nv
    -> fp32 [M, N], K >= 32 (the FP8 MMA's K; products exact, sums in fp32, or fewer bits on sm_90: keep K a step
    small and add the steps in fp32); targets without FP8 refuse it (ir.fp8_free)."""
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
        raise TraceError(f"dot needs [M, K] @ [K, N], got {a.type} @ {b.type}")
    if builtins.min(*a.shape, b.shape[1]) < 16:
        raise TraceError(f"dot dims must be >= 16, got {a.shape} @ {b.shape}")
    if (a.dtype == int8 and b.dtype == int8) or (a.dtype == float8e4nv and b.dtype == float8e4nv):
        if a.shape[1] < 32:
            raise TraceError(f"an {a.dtype} dot needs K >= 32, got {a.shape} @ {b.shape}")
        out = _op("dot", [a, b], TileType(int32 if a.dtype == int8 else float32, (a.shape[0], b.shape[1])))
        return out if acc is None else out + acc
    if float8e4nv in (a.dtype, b.dtype):
        raise TraceError(f"an fp8 dot takes two fp8e4nv tiles, got {a.dtype} and {b.dtype} (convert the fp8 one to "
                         "the other's dtype first)")
    dtype = _promote(a.dtype, b.dtype)
    if not dtype.is_float:
        raise TraceError(f"dot is for floats or int8 pairs, got {a.dtype} and {b.dtype}")
    out = _op("dot", [_cast(a, dtype), _cast(b, dtype)], TileType(float32, (a.shape[0], b.shape[1])))
    return out if acc is None else out + acc


# --- loops -----------------------------------------------------------------------------------------------------


def static_range(start: int, stop: int | None = None, step: int = 1) -> range:
    """A constexpr loop: unrolled while tracing."""
    return range(start, stop, step) if stop is not None else range(start)


def fori_loop(lo, hi, body, init=(), step: int = 1, stages: int = 0):
    """A runtime loop: `carry = body(i, *carry)` for i in range(lo, hi, step); returns the final carry.

    `lo`/`hi` are i32 scalars (runtime values or ints), `step` a nonzero int. `init` is one value or a tuple;
    the body returns the same number of values, each of its init's dtype and shape (scalars are broadcast).
    `stages` (Triton only; 0: none): software-pipeline the loop's loads over that many stages (`tl.range`'s
    num_stages: cp.async into shared memory, stages - 1 steps ahead), which Triton does not do unasked for a loop
    whose loads feed no dot; the other targets run the loop as written.
    """
    b = current()
    single = not isinstance(init, tuple | list)
    inits = [_lift(x) for x in ([init] if single else init)]
    bounds = [_cast(_lift(x, int32), int32) for x in (lo, hi)]
    if any(t.shape for t in bounds) or not isinstance(step, int) or step == 0:
        raise TraceError("fori_loop bounds are scalars and step a nonzero int")
    if not isinstance(stages, int) or stages < 0 or stages == 1:
        raise TraceError(f"fori_loop stages {stages!r}: 0 (none) or a pipelining depth of 2 or more")
    from .ir import Block

    block = Block(parent=b.block)
    block.args = [b.value(TileType(int32), block)] + [b.value(t.type, block) for t in inits]
    b.block = block
    try:
        out = body(*(Tile(v) for v in block.args))
        outs = [out] if single and inits else list(out or ())
        if len(outs) != len(inits):
            raise TraceError(f"fori_loop body returned {len(outs)} values for {len(inits)} carried")
        for k, (o, i) in enumerate(zip(outs, inits, strict=True)):
            o = _lift(o, i.dtype)
            if o.dtype != i.dtype or (o.shape and o.shape != i.shape):
                raise TraceError(f"loop-carried value {k} changes from {i.type} to {o.type}")
            if o.shape != i.shape:
                o = full(i.shape, o, i.dtype)
            if not o.v.block.encloses(block):
                raise TraceError(f"loop-carried value {k} is not visible in the body")
            block.yields.append(o.v)
    finally:
        b.block = block.parent
    op = b.emit("for", [t.v for t in bounds + inits], {"step": step} | ({"stages": stages} if stages else {}),
                [t.type for t in inits])
    op.body = block
    res = [Tile(v) for v in op.results]
    return (res[0] if res else None) if single else tuple(res)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (builtins.max(int(n), 1) - 1).bit_length()
