"""The oracle: runs a KernelIR with numpy, one program of the grid at a time, each op vectorised over its tile.

Pointer arguments are numpy arrays (views allowed: a pointer starts at the view's first element, as a device
pointer would) or CPU torch tensors; stores write through to them. Reading masked-in elements outside the buffer
raises; masked loads without `other` return poison (NaN, or the integer maximum) so kernels relying on them fail.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .ir import Block, DType, KernelIR, Op, PtrType

_erf = np.frompyfunc(math.erf, 1, 1)


class Ptr:
    """A tile of pointers: a flat buffer and element offsets into it."""

    __slots__ = ("buf", "off", "bf16")

    def __init__(self, buf: np.ndarray, off, bf16: bool = False):
        self.buf, self.off, self.bf16 = buf, off, bf16


def round_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded (to nearest even) to bf16, kept as fp32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return np.where(np.isnan(x), np.float32("nan"), u.view(np.float32))


def _as_buffer(a, elem: DType) -> Ptr:
    """A flat buffer that shares memory with `a` and the offset of `a`'s first element in it."""
    if hasattr(a, "untyped_storage"):  # torch: a flat view of the whole storage
        import torch

        t = a.view(torch.int16) if a.dtype == torch.bfloat16 else a
        flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        arr, off = flat.numpy(), t.storage_offset()
    else:
        arr = np.asarray(a)
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root is not arr and root.flags.c_contiguous:
            flat = root.reshape(-1).view(np.uint8).view(arr.dtype) if root.dtype != arr.dtype else root.reshape(-1)
            off = (arr.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // arr.itemsize
            arr = flat
        else:
            if not arr.flags.c_contiguous:
                raise ValueError("pointer arguments must be contiguous arrays or views into one")
            arr, off = arr.reshape(-1), 0
    if elem.name == "bf16":
        if arr.itemsize != 2 or arr.dtype.kind not in "iu":
            raise TypeError(f"buffer of {arr.dtype} for a bf16 pointer (pass a bf16 tensor or its uint16 bits)")
        return Ptr(arr.view(np.uint16), off, bf16=True)
    if arr.dtype != elem.np:
        raise TypeError(f"buffer of {arr.dtype} for a {elem} pointer")
    return Ptr(arr, off)


def _load(p: Ptr, mask=None, other=None, dtype: DType | None = None):
    off = np.asarray(p.off, np.int64)
    m = np.ones(off.shape, bool) if mask is None else np.broadcast_to(mask, off.shape)
    bad = m & ((off < 0) | (off >= p.buf.size))
    if bad.any():
        raise IndexError(f"load out of bounds at offsets {off[bad][:8]} (buffer of {p.buf.size})")
    vals = p.buf[np.where(m, off, 0)]
    if p.bf16:
        vals = (vals.astype(np.uint32) << 16).view(np.float32)
    if mask is None:
        return vals
    if other is None:
        other = np.nan if dtype.is_float else (True if dtype.kind == "b" else np.iinfo(dtype.np).max)
    return np.where(m, vals, other)


def _store(p: Ptr, val, mask=None):
    off = np.asarray(p.off, np.int64)
    val = np.broadcast_to(val, off.shape)
    m = np.ones(off.shape, bool) if mask is None else np.broadcast_to(mask, off.shape)
    bad = m & ((off < 0) | (off >= p.buf.size))
    if bad.any():
        raise IndexError(f"store out of bounds at offsets {off[bad][:8]} (buffer of {p.buf.size})")
    if p.bf16:
        val = (round_bf16(val).view(np.uint32) >> 16).astype(np.uint16)
    p.buf[off[m]] = val[m]


def _idiv(a, b):
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "idiv": _idiv, "mod": np.fmod,
    "max": np.maximum, "min": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "shl": np.left_shift, "shr": np.right_shift, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
}
_UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
    "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
    "erf": lambda x: _erf(x).astype(np.float32), "floor": np.floor, "ceil": np.ceil,
    "not": lambda x: np.logical_not(x) if x.dtype == bool else np.invert(x),
}
_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


class _Program:
    def __init__(self, pid: tuple[int, int, int], grid: tuple[int, int, int]):
        self.pid, self.grid = pid, grid

    def run_block(self, block: Block, env: dict) -> None:
        for op in block.ops:
            if op.opcode == "for":
                self.run_for(op, env)
                continue
            out = self.run_op(op, [env[a.id] for a in op.args])
            if op.results:
                r = op.result
                if not isinstance(r.dtype, PtrType):
                    out = np.asarray(out).astype(r.dtype.np, copy=False)
                    if r.dtype.name == "bf16" and op.opcode not in ("load", "const"):
                        out = round_bf16(out)
                    if out.shape != r.shape:
                        raise AssertionError(f"{op.opcode} made shape {out.shape}, IR says {r.type}")
                env[r.id] = out

    def run_for(self, op: Op, env: dict) -> None:
        lo, hi, *carry = (env[a.id] for a in op.args)
        iv, *args = op.body.args
        for i in range(int(lo), int(hi), op.attrs["step"]):
            env[iv.id] = np.int32(i)
            for a, c in zip(args, carry, strict=True):
                env[a.id] = c
            self.run_block(op.body, env)
            carry = [env[y.id] for y in op.body.yields]
        for r, c in zip(op.results, carry, strict=True):
            env[r.id] = c

    def run_op(self, op: Op, a: list):
        code, at = op.opcode, op.attrs
        if code in _BINARY:
            return _BINARY[code](a[0], a[1])
        if code in _UNARY:
            return _UNARY[code](a[0])
        if code == "const":
            return np.asarray(at["value"], dtype=op.result.dtype.np)
        if code == "program_id":
            return np.int32(self.pid[at["axis"]])
        if code == "num_programs":
            return np.int32(self.grid[at["axis"]])
        if code == "arange":
            return np.arange(at["start"], at["end"], dtype=np.int32)
        if code in ("cast", "bitcast"):
            return _convert(a[0], op.args[0].dtype, at.get("to", op.result.dtype), code == "bitcast")
        if code == "where":
            return np.where(a[0], a[1], a[2])
        if code == "dot4":
            return _dot4(*a, at["signed_a"], at["signed_b"])
        if code == "broadcast":
            if isinstance(a[0], Ptr):
                return Ptr(a[0].buf, np.broadcast_to(a[0].off, at["shape"]), a[0].bf16)
            return np.broadcast_to(a[0], at["shape"])
        if code == "expand_dims":
            if isinstance(a[0], Ptr):
                return Ptr(a[0].buf, np.expand_dims(a[0].off, at["axis"]), a[0].bf16)
            return np.expand_dims(a[0], at["axis"])
        if code == "reshape":
            if isinstance(a[0], Ptr):
                return Ptr(a[0].buf, np.reshape(a[0].off, at["shape"]), a[0].bf16)
            return np.reshape(a[0], at["shape"])
        if code == "trans":
            return a[0].T
        if code == "reduce":
            return _REDUCE[at["kind"]](a[0], axis=at["axis"])
        if code == "dot":
            if op.result.dtype.is_int:  # int8 pairs: exact in int64, wrapped to int32 as the MMA does
                s = np.matmul(a[0].astype(np.int64), a[1].astype(np.int64))
                return (s & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
            if op.args[0].dtype.name == "fp8e4nv":  # bytes: products exact in fp32, as the MMA's
                a = [_convert(v, op.args[0].dtype, op.result.dtype, False) for v in a]
            return np.matmul(a[0].astype(np.float32), a[1].astype(np.float32))
        if code == "ptr_add":
            return Ptr(a[0].buf, np.asarray(a[0].off, np.int64) + np.asarray(a[1], np.int64), a[0].bf16)
        if code == "ptr_cast":
            return _ptr_cast(a[0], op.result.dtype.elem)
        if code == "load":
            return _load(*a, dtype=op.result.dtype)
        if code == "store":
            return _store(*a)
        if code in ("grid_dep_wait", "grid_dep_launch", "barrier"):  # one program at a time, each in program order
            return None
        if code == "atomic_add":  # programs run one after another: a read, an add and a write are atomic here
            return _atomic_add(*a)
        raise NotImplementedError(f"interpreter: no rule for {code}")


def _atomic_add(p: Ptr, val, mask=None):
    """The value at scalar pointer p before adding val (masked off: nothing changes, 0 comes back)."""
    if mask is not None and not mask:
        return np.zeros((), p.buf.dtype)
    old = _load(p)
    _store(p, old + val)
    return old


def _dot4(a, b, acc, signed_a: bool, signed_b: bool):
    """acc + the dot product of the 4 bytes of a and b (uint8 or int8 each), wrapped to int32."""
    def byte(w, k, signed):
        v = (np.asarray(w).astype(np.uint32) >> np.uint32(8 * k)) & np.uint32(0xFF)
        return v.astype(np.uint8).view(np.int8).astype(np.int64) if signed else v.astype(np.int64)
    s = np.asarray(acc).astype(np.int64) + sum(byte(a, k, signed_a) * byte(b, k, signed_b) for k in range(4))
    return np.asarray(s & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def _convert(x, src: DType, dst: DType, bitcast: bool):
    if bitcast:
        x = np.asarray(x)
        if src.name == "bf16":
            x = (round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)
        if dst.name == "bf16":
            return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return x.view(dst.np)
    if src.name == "fp8e4nv":  # held as its bytes; e4m3 values are exact in every float type it converts to
        from ir.formats.fp8_blocks import E4M3  # the format's table: 0x7F / 0xFF are NaN, as the hardware's cvt

        return E4M3[np.asarray(x, np.uint8)].astype(dst.np)
    if dst.kind == "b":
        return np.asarray(x) != 0
    if dst.is_int and src.is_float:  # truncation toward zero, as C and Triton; NaN and overflow undefined
        return np.trunc(np.nan_to_num(x)).astype(dst.np)
    return np.asarray(x).astype(dst.np)


def _ptr_cast(p: Ptr, elem: DType) -> Ptr:
    src_size = 2 if p.bf16 else p.buf.itemsize
    dst = np.dtype(np.uint16) if elem.name == "bf16" else elem.np
    nbytes = p.buf.size * src_size // dst.itemsize * dst.itemsize
    off = np.asarray(p.off, np.int64) * src_size
    if np.any(off % dst.itemsize):
        raise ValueError(f"pointer cast to {elem} at a misaligned offset")
    return Ptr(p.buf.view(np.uint8)[:nbytes].view(dst), off // dst.itemsize, elem.name == "bf16")


def _arg(value, p) -> object:
    t = p.dtype
    if isinstance(t, PtrType):
        return _as_buffer(value, t.elem)
    return np.asarray(value, dtype=t.np)[()]


def run(k: KernelIR, grid, *args) -> None:
    """Run every program of `grid` (an int or a tuple of up to three) on `args`, in parameter order."""
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    grid = grid + (1,) * (3 - len(grid))
    if len(args) != len(k.params):
        raise TypeError(f"{k.name} takes {len(k.params)} arguments ({', '.join(map(repr, k.params))}), "
                        f"got {len(args)}")
    base = {p.id: _arg(a, p) for p, a in zip(k.params, args, strict=True)}
    with np.errstate(all="ignore"):
        for pid in itertools.product(*(range(g) for g in grid)):
            _Program(pid, grid).run_block(k.body, dict(base))

