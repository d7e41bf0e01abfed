"""The SIMT lowering: a tile KernelIR -> a SimtKernel, the per-thread program of one threadgroup of `nthreads`.

One program is one threadgroup (a CUDA block). Each tile value takes one of four forms:
  Uni   a uniform scalar (shape-() values, reductions to a scalar), one variable in every thread;
  Virt  an index expression (arange, constants, masks and offsets built from them): never stored, recomputed
        at whatever element a consumer needs, so index math moves between layouts for free;
  Regs  a register array per thread under a Layout (layout.py): elementwise ops loop over the thread's slots;
  Ptr   a uniform base pointer plus an integer offset tile (pointer tiles never sit in registers).
Loads, reductions and dot produce Regs. Operands of one op in layouts that map threads differently meet
through threadgroup memory ("smem": one scratch area; a barrier before it is rewritten once read). Reductions
combine slots inside a thread, lanes by simdgroup shuffles (simd_sum when the reduced bits span the simdgroup),
simdgroups through smem. `dot` stages K-chunks of both operands in smem, each thread computing its outputs.

The SIMT form is KernelIR-shaped (ir.Op/Block/Value; every value a per-thread scalar or, with shape (n,), a
register array) so one C-like renderer spells it for every target. Opcodes beyond the tile IR's scalar ones:
  tid | bitmap(x){runs} | alloc{n} | get(a, i) | set(a, i, x) | var(x) | assign(var, x)
  gload(p, off[, mask, other]) | gstore(p, off, x) | sload(i){dtype, base} | sstore(i, x){base} | barrier
  shfl_xor(x){mask} | simd_reduce(x){kind} | if(c){body} | loop(lo, hi){step, unroll; body(iv)}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import layout as lay
from .ir import Block, DType, KernelIR, Op, PtrType, TileType, Value, bool_, fp32, i32
from .layout import Layout

DOT_SMEM = 16384  # bytes of threadgroup memory one dot stage may take (K is chunked to fit)


@dataclass
class Uni:
    v: Value


@dataclass(eq=False)
class Virt:
    fn: object  # index Value -> scalar Value, emitted where called
    shape: tuple[int, ...]
    dtype: DType


@dataclass
class Regs:
    arr: Value
    lay: Layout
    smap: tuple  # per slot bit of `lay`: the bit of the array index it sits at (None: repeated)
    src: tuple | None = None  # a broadcast view: (the Regs broadcast, {flat bit here: flat bit there})


@dataclass
class Ptr:
    base: Value
    off: object | None  # Virt | Regs | None
    shape: tuple[int, ...] = ()


@dataclass(eq=False)
class SimtKernel:
    name: str
    params: list[Value]
    body: Block
    nthreads: int
    smem_bytes: int
    grid_rank: int
    written: set[str]  # pointer params stored through
    loaded: set[str]  # pointer params loaded through
    readonly: set[int] = field(default_factory=set)  # ids of pointer values that never write
    constexprs: dict = field(default_factory=dict)


def itemsize(t: DType) -> int:
    return max(1, t.bits // 8)


def poison(t: DType):
    return True if t.kind == "b" else float("nan") if t.is_float else (1 << (t.bits - (t.kind == "i"))) - 1


class Lowering:
    def __init__(self, k: KernelIR, nthreads: int):
        self.k, self.T = k, nthreads
        self.count = 1 + max([p.id for p in k.params] + [r.id for op in k.walk() for r in op.results]
                             + [a.id for op in k.walk() if op.body for a in op.body.args], default=0)
        self.pro, self.block = Block(None), Block(None)
        self.env: dict[int, object] = {}
        self.scopes: list[dict] = [{}]
        self.dirty, self.smem_bytes, self.moved_total = False, 0, 0
        self.roots: dict[int, str] = {}  # pointer value id -> the param it derives from
        self.written: set[str] = set()
        self.loaded: set[str] = set()
        self.tid = self.emit("tid", (), i32, into=self.pro)

    # --- emitting ----------------------------------------------------------------------------------------------

    def value(self, type: TileType, block: Block) -> Value:
        self.count += 1
        return Value(self.count, type, None, block)

    def emit(self, opcode, args=(), dtype=None, n=None, into=None, **attrs):
        block = into or self.block
        op = Op(opcode, tuple(args), attrs)
        if dtype is not None:
            v = self.value(TileType(dtype, (n,) if n else ()), block)
            v.op = op
            op.results = [v]
        block.ops.append(op)
        return op.results[0] if op.results else op

    def const(self, value, dtype: DType = i32) -> Value:
        return self.emit("const", (), dtype, value=value)

    def nested(self, op: Op, args=()) -> Block:
        op.body = Block(self.block, list(args))
        return op.body

    def run_in(self, body: Block, fn):
        outer = self.block
        self.block = body
        self.scopes.append({})
        try:
            return fn()
        finally:
            self.scopes.pop()
            self.block = outer

    def memo(self, key, make):
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        self.scopes[-1][key] = out = make()
        return out

    def if_(self, cond: Value | None, fn) -> None:
        if cond is None:
            return fn()
        op = self.emit("if", (cond,))
        self.run_in(self.nested(op), fn)

    def loop(self, lo: Value, hi: Value, fn, step: int = 1, unroll: bool = False) -> None:
        op = self.emit("loop", (lo, hi), step=step, unroll=unroll)
        iv = self.value(TileType(i32), None)
        iv.block = self.nested(op, [iv])
        self.run_in(op.body, lambda: fn(iv))

    def for_slots(self, layout: Layout, fn) -> None:
        if layout.nslots == 1:
            return fn(self.const(0))
        self.loop(self.const(0), self.const(layout.nslots), fn, unroll=True)

    def bitmap(self, x: Value, pairs, xbits: int | None = None) -> Value:
        """Bits of x gathered to new positions; `xbits`: x < 2**xbits is known (an identity then emits nothing)."""
        r = lay.runs(pairs)
        if not r:
            return self.const(0)
        if r == ((0, 0, xbits),):
            return x
        return self.emit("bitmap", (x,), i32, runs=r)

    # --- layouts: thread parts, indices, owners -----------------------------------------------------------------

    def thread_part(self, layout: Layout) -> Value | None:
        pairs = layout.thread_pairs()
        if not pairs:
            return None
        key = ("tpart", lay.runs(pairs))
        if key not in self.scopes[0]:
            self.scopes[0][key] = self.emit("bitmap", (self.tid,), i32, into=self.pro, runs=key[1])
        return self.scopes[0][key]

    def owner(self, layout: Layout) -> Value | None:
        mask = layout.replicated_mask
        if not mask:
            return None
        key = ("own", mask)
        if key not in self.scopes[0]:
            m = self.emit("and", (self.tid, self.emit("const", (), i32, into=self.pro, value=mask)), i32,
                          into=self.pro)
            self.scopes[0][key] = self.emit("eq", (m, self.emit("const", (), i32, into=self.pro, value=0)), bool_,
                                            into=self.pro)
        return self.scopes[0][key]

    def index(self, layout: Layout, r: Value) -> Value:
        """Flat element index held at slot r of this thread."""
        def make():
            t = self.thread_part(layout)
            s = self.bitmap(r, list(enumerate(layout.rbits)), len(layout.rbits)) if layout.rbits else None
            if t is None or s is None:
                return t if s is None else s
            return self.emit("or", (t, s), i32)
        if not layout.thread_pairs() and not layout.rbits:
            return self.const(0)
        return self.memo(("ix", layout.tbits, layout.rbits, r.id), make)

    def slot(self, regs: Regs, r: Value) -> Value:
        """The array index of layout slot r of a Regs value."""
        if regs.smap == tuple(range(len(regs.smap))):
            return r
        return self.bitmap(r, [(k, p) for k, p in enumerate(regs.smap) if p is not None], len(regs.smap))

    # --- operands in a layout -----------------------------------------------------------------------------------

    def choose(self, infos, shape) -> Layout:
        """The layout of an op's result: the operands' layout that moves the fewest elements through smem."""
        regs = [i for i in infos if isinstance(i, Regs)]
        if not regs:
            return lay.canonical(shape, self.T)
        cost = lambda c: (sum(self.moved(r, c) for r in regs), c.nslots)  # noqa: E731
        return min((r.lay for r in regs), key=cost)

    @staticmethod
    def project(info: Regs, layout: Layout) -> Layout:
        """`layout` seen from a broadcast view's source: broadcast bits drop out (replicated or repeated)."""
        src, inv = info.src
        return Layout(src.lay.shape, tuple(None if b is None else inv.get(b) for b in layout.tbits),
                      tuple(inv[b] for b in layout.rbits if b in inv))

    def moved(self, info: Regs, layout: Layout) -> int:
        """Elements a conversion of `info` to `layout` moves through threadgroup memory."""
        if info.lay.same_threads(layout):
            return 0
        if info.src is not None:
            return self.moved(info.src[0], self.project(info, layout))
        return 1 << lay.nbits(info.lay.shape)

    def adapt(self, info, layout: Layout):
        """`info` readable at `layout`'s slots inside an element loop: Uni and Virt as they are, Regs renumbered
        (same threads) or moved through threadgroup memory (a broadcast view: its source, then re-broadcast)."""
        if not isinstance(info, Regs):
            return info
        if not info.lay.same_threads(layout) and info.src is not None:
            src, inv = info.src
            sub = self.project(info, layout)
            conv = self.adapt(src, sub)
            return Regs(conv.arr, layout, tuple(conv.smap[sub.rbits.index(inv[b])] if b in inv else None
                                                for b in layout.rbits))
        if not info.lay.same_threads(layout):
            info = self.memo(("conv", info.arr.id, info.smap, info.lay, layout), lambda: self.convert(info, layout))
        smap = tuple(info.smap[info.lay.rbits.index(b)] for b in layout.rbits)
        return Regs(info.arr, layout, smap)

    def at(self, info, layout: Layout, r: Value) -> Value:
        if isinstance(info, Uni):
            return info.v
        if isinstance(info, Virt):
            ix = self.index(layout, r)
            return self.memo(("virt", id(info), ix.id), lambda: info.fn(ix))
        return self.emit("get", (info.arr, self.slot(info, r)), info.arr.dtype)

    def materialize(self, info, layout: Layout | None = None, shape=None, dtype=None) -> Regs:
        if isinstance(info, Regs) and (layout is None or info.lay.same_threads(layout)):
            return self.adapt(info, layout or info.lay)
        shape = info.shape if shape is None else shape
        dtype = dtype or (info.dtype if isinstance(info, Virt) else info.v.dtype)
        layout = layout or lay.canonical(shape, self.T)
        src = self.adapt(info, layout)
        out = self.emit("alloc", (), dtype, n=layout.nslots)
        self.for_slots(layout, lambda r: self.emit("set", (out, r, self.at(src, layout, r))))
        return Regs(out, layout, tuple(range(len(layout.rbits))))

    # --- threadgroup memory -------------------------------------------------------------------------------------

    def need_smem(self, nbytes: int) -> None:
        self.smem_bytes = max(self.smem_bytes, -(-nbytes // 16) * 16)

    def barrier(self) -> None:
        self.emit("barrier")
        self.dirty = False

    def before_write(self) -> None:
        if self.dirty:
            self.barrier()

    def convert(self, src: Regs, layout: Layout) -> Regs:
        dtype = src.arr.dtype
        self.moved_total += 1 << lay.nbits(layout.shape)
        self.need_smem((1 << lay.nbits(layout.shape)) * itemsize(dtype))
        self.before_write()
        self.if_(self.owner(src.lay), lambda: self.for_slots(src.lay, lambda r: self.emit(
            "sstore", (self.index(src.lay, r), self.at(src, src.lay, r)), base=0)))
        self.barrier()
        out = self.emit("alloc", (), dtype, n=layout.nslots)
        self.for_slots(layout, lambda r: self.emit("set", (out, r, self.emit(
            "sload", (self.index(layout, r),), dtype, base=0))))
        self.dirty = True
        return Regs(out, layout, tuple(range(len(layout.rbits))))


def lower(k: KernelIR, num_warps: int = 4) -> SimtKernel:
    """The SIMT form of `k` for threadgroups of num_warps * 32 threads."""
    from .simt_ops import OpLowering

    low = OpLowering(k, num_warps * 32)
    for p in k.params:
        low.env[p.id] = Ptr(p, None) if isinstance(p.dtype, PtrType) else Uni(p)
        if isinstance(p.dtype, PtrType):
            low.roots[p.id] = p.name
    low.lower_block(k.body)
    body = Block(None, [], low.pro.ops + low.block.ops)
    for op in body.ops:
        if op.body is not None:
            op.body.parent = body
    readonly = {vid for vid, root in low.roots.items() if root not in low.written}
    return SimtKernel(k.name, k.params, body, low.T, low.smem_bytes, k.grid_rank, low.written, low.loaded,
                      readonly, dict(k.constexprs))


__all__ = ["DOT_SMEM", "Lowering", "Ptr", "Regs", "SimtKernel", "Uni", "Virt", "fp32", "itemsize", "lower", "poison"]
