"""The SIMT lowering of each tile op (see simt.py for the forms values take and the SIMT opcodes)."""

from __future__ import annotations

from . import layout as lay
from .ir import ELEMENTWISE, Block, Op, PtrType, Value, bool_, fp32, i32, i64
from .layout import Layout
from .simt import DOT_SMEM, Ptr, Regs, Uni, Virt, itemsize, poison
from .simt_loops import LoopLowering, ident

COMBINE = {"sum": "add", "max": "max", "min": "min"}


def dtype_of(info):
    return info.v.dtype if isinstance(info, Uni) else info.dtype if isinstance(info, Virt) else info.arr.dtype


def shape_of(info):
    return () if isinstance(info, Uni) else info.shape if isinstance(info, Virt | Ptr) else info.lay.shape


class OpLowering(LoopLowering):
    def lower_block(self, block: Block) -> None:
        for op in block.ops:
            args = [self.env[a.id] for a in op.args]
            handler = getattr(self, f"op_{op.opcode}", None)
            if handler is not None:
                out = handler(op, args)
            elif op.opcode in ELEMENTWISE:
                out = self.ewise(op.opcode, op.attrs, op.result.dtype, op.result.shape, args)
            else:
                raise NotImplementedError(f"SIMT lowering: no rule for {op.opcode}")
            if op.results and op.opcode != "for":
                self.env[op.result.id] = out

    # --- elementwise and index expressions ---------------------------------------------------------------------

    def virt_at(self, info, ix: Value) -> Value:
        if isinstance(info, Uni):
            return info.v
        return self.memo(("virt", id(info), ix.id), lambda: info.fn(ix))

    def ewise(self, code: str, attrs: dict, dtype, shape, infos):
        if all(isinstance(i, Uni) for i in infos):
            return Uni(self.emit(code, [i.v for i in infos], dtype, **attrs))
        if not any(isinstance(i, Regs) for i in infos):
            return Virt(lambda ix: self.emit(code, [self.virt_at(i, ix) for i in infos], dtype, **attrs), shape, dtype)
        layout = self.choose(infos, shape)
        srcs = [self.adapt(i, layout) for i in infos]
        out = self.emit("alloc", (), dtype, n=layout.nslots)
        self.for_slots(layout, lambda r: self.emit("set", (out, r, self.emit(
            code, [self.at(s, layout, r) for s in srcs], dtype, **attrs))))
        return Regs(out, layout, ident(layout))

    def remap(self, info, shape, pairs_dst_src, layout_fn):
        """A view of `info` at a new shape whose flat-index bits move: Virt re-indexes, Regs relabel their layout."""
        if isinstance(info, Uni):
            return Virt(lambda ix: info.v, shape, info.v.dtype)
        if isinstance(info, Virt):
            return Virt(lambda ix: self.virt_at(info, self.bitmap(ix, pairs_dst_src)), shape, info.dtype)
        return layout_fn(info)

    def op_const(self, op: Op, args):
        return Uni(self.const(op.attrs["value"], op.result.dtype))

    def op_program_id(self, op: Op, args):
        return Uni(self.emit(op.opcode, (), i32, axis=op.attrs["axis"]))

    op_num_programs = op_program_id

    def op_arange(self, op: Op, args):
        start = op.attrs["start"]
        return Virt(lambda ix: self.emit("add", (ix, self.const(start)), i32) if start else ix, op.result.shape, i32)

    def op_broadcast(self, op: Op, args):
        (x,), shape = args, tuple(op.attrs["shape"])
        if isinstance(x, Ptr):
            return Ptr(x.base, None if x.off is None else self.broadcast(x.off, shape), shape)
        return self.broadcast(x, shape)

    def broadcast(self, x, shape):
        def regs(r: Regs):
            out, src = lay.broadcast(r.lay, shape)
            return Regs(r.arr, out, tuple(None if k is None else r.smap[k] for k in src), (r, inv))
        fwd = {} if isinstance(x, Uni) else lay.bit_map(shape_of(x), shape)
        inv = {d: s for s, d in fwd.items()}
        pairs = list(inv.items())
        return self.remap(x, shape, pairs, regs)

    def op_expand_dims(self, op: Op, args):
        (x,), shape = args, op.result.shape
        if isinstance(x, Ptr):
            return Ptr(x.base, None if x.off is None else self.op_expand_dims(op, [x.off]), shape)
        nb = lay.nbits(shape)
        return self.remap(x, shape, [(b, b) for b in range(nb)],
                          lambda r: Regs(r.arr, r.lay.with_shape(shape), r.smap, r.src))

    def op_reshape(self, op: Op, args):
        """Row-major: flat indices stay, so index expressions and register layouts only take the new shape."""
        (x,), shape = args, op.result.shape
        if isinstance(x, Ptr):
            return Ptr(x.base, None if x.off is None else self.op_reshape(op, [x.off]), shape)
        return self.remap(x, shape, [(b, b) for b in range(lay.nbits(shape))],
                          lambda r: Regs(r.arr, r.lay.with_shape(shape), r.smap, r.src))

    def op_trans(self, op: Op, args):
        (x,) = args
        if isinstance(x, Ptr):
            return Ptr(x.base, None if x.off is None else self.op_trans(op, [x.off]), op.result.shape)
        pairs = [(d, s) for s, d in lay.transpose_bits(shape_of(x)).items()]
        return self.remap(x, op.result.shape, pairs, lambda r: Regs(r.arr, lay.transpose(r.lay), r.smap))

    # --- pointers, loads and stores ------------------------------------------------------------------------------

    def cast_to(self, info, dtype):
        return info if dtype_of(info) == dtype else self.ewise("cast", {"to": dtype}, dtype, shape_of(info), [info])

    def op_ptr_add(self, op: Op, args):
        p, o = args
        if p.off is None and isinstance(o, Uni):
            base = self.emit("ptr_add", (p.base, o.v), p.base.dtype)
            self.roots[base.id] = self.roots[p.base.id]
            return Ptr(base, None, p.shape)
        shape = op.result.shape
        if p.off is None:
            return Ptr(p.base, o, shape)
        t = i64 if i64 in (dtype_of(p.off), dtype_of(o)) else i32
        return Ptr(p.base, self.ewise("add", {}, t, shape, [self.cast_to(p.off, t), self.cast_to(o, t)]), shape)

    def op_ptr_cast(self, op: Op, args):
        (p,) = args
        src, dst = p.base.dtype.elem, op.result.dtype.elem
        base = self.emit("ptr_cast", (p.base,), PtrType(dst))
        self.roots[base.id] = self.roots[p.base.id]
        off, (s, d) = p.off, (itemsize(src), itemsize(dst))
        if off is not None and s != d:
            code, k = ("mul", s // d) if s > d else ("idiv", d // s)
            t = dtype_of(off)
            off = self.ewise(code, {}, t, shape_of(off), [off, Uni(self.const(k, t))])
        return Ptr(base, off, p.shape)

    def op_load(self, op: Op, args):
        p, mask, other = (args + [None, None])[:3]
        dtype, shape = op.result.dtype, op.result.shape
        self.loaded.add(self.roots[p.base.id])
        if mask is not None and other is None:
            other = Uni(self.const(poison(dtype), dtype))
        if not shape:
            extra = [] if mask is None else [mask.v, other.v]
            return Uni(self.emit("gload", [p.base, self.const(0)] + extra, dtype))
        infos = [i for i in (p.off, mask, other) if i is not None]
        layout = self.choose(infos, shape)
        off, mask, other = (None if i is None else self.adapt(i, layout) for i in (p.off, mask, other))
        out = self.emit("alloc", (), dtype, n=layout.nslots)

        def body(r):
            a = [p.base, self.const(0) if off is None else self.at(off, layout, r)]
            a += [] if mask is None else [self.at(mask, layout, r), self.at(other, layout, r)]
            self.emit("set", (out, r, self.emit("gload", a, dtype)))
        self.for_slots(layout, body)
        return Regs(out, layout, ident(layout))

    def op_grid_dep_wait(self, op: Op, args):  # launches from these targets run one after another
        return None

    op_grid_dep_launch = op_grid_dep_wait

    def op_barrier(self, op: Op, args):
        self.barrier()

    def op_atomic_add(self, op: Op, args):  # launch.source refuses these first (ir.atomics_free)
        raise ValueError(f"kernel {self.k.name}: the SIMT targets do not support atomics (op {op.opcode})")

    def op_store(self, op: Op, args):
        p, val, mask = (args + [None])[:3]
        shape = op.args[0].shape
        self.written.add(self.roots[p.base.id])
        if not shape:
            first = self.owner(Layout((), (None,) * lay.log2(self.T), ()))
            cond = first if mask is None else self.emit("and", (first, mask.v), mask.v.dtype)
            self.if_(cond, lambda: self.emit("gstore", (p.base, self.const(0), val.v)))
            return None
        layout = val.lay if isinstance(val, Regs) else self.choose([i for i in (p.off, mask) if i], shape)
        off, val, mask = (None if i is None else self.adapt(i, layout) for i in (p.off, val, mask))

        def body(r):
            o = self.const(0) if off is None else self.at(off, layout, r)
            v = self.at(val, layout, r)
            self.if_(None if mask is None else self.at(mask, layout, r),
                     lambda: self.emit("gstore", (p.base, o, v)))
        self.if_(self.owner(layout), lambda: self.for_slots(layout, body))
        return None

    # --- reductions and dot --------------------------------------------------------------------------------------

    def tid_bits(self, pairs) -> Value:
        key = ("tbits", lay.runs(pairs))
        if key not in self.scopes[0]:
            self.scopes[0][key] = self.emit("bitmap", (self.tid,), i32, into=self.pro, runs=key[1])
        return self.scopes[0][key]

    def op_reduce(self, op: Op, args):
        x = args[0] if isinstance(args[0], Regs) else self.materialize(args[0])
        plan, dtype = lay.reduce(x.lay, op.attrs["axis"]), op.result.dtype
        comb = COMBINE[op.attrs["kind"]]
        keep = [(i, x.smap[k]) for i, k in enumerate(plan.slot_keep) if x.smap[k] is not None]
        axis = [(i, x.smap[k]) for i, k in enumerate(plan.slot_axis) if x.smap[k] is not None]
        part = self.emit("alloc", (), dtype, n=plan.out.nslots)

        def per_slot(r):
            base = self.bitmap(r, keep, len(plan.slot_keep))
            acc = self.emit("var", (self.emit("get", (x.arr, base), dtype),), dtype)
            if plan.slot_axis:
                def step(a):
                    idx = self.emit("or", (base, self.bitmap(a, axis, len(plan.slot_axis))), i32)
                    self.emit("assign", (acc, self.emit(comb, (acc, self.emit("get", (x.arr, idx), dtype)), dtype)))
                self.loop(self.const(1), self.const(1 << len(plan.slot_axis)), step, unroll=True)
            v = acc
            if sorted(plan.lane_axis) == list(range(lay.LANE_BITS)):
                v = self.emit("simd_reduce", (v,), dtype, kind=op.attrs["kind"])
            for j in plan.lane_axis if len(plan.lane_axis) < lay.LANE_BITS else ():
                v = self.emit(comb, (v, self.emit("shfl_xor", (v,), dtype, mask=1 << j)), dtype)
            self.emit("set", (part, r, v))
        self.for_slots(plan.out, per_slot)
        if plan.warp_axis:
            part = self.across_warps(plan, x.lay, part, dtype, comb)
        if not plan.out.shape:
            return Uni(self.emit("get", (part, self.const(0)), dtype))
        return Regs(part, plan.out, ident(plan.out))

    def across_warps(self, plan, src: Layout, part: Value, dtype, comb: str) -> Value:
        nw = len(plan.warp_axis)
        self.need_smem((1 << (lay.nbits(plan.out.shape) + nw)) * itemsize(dtype))
        self.before_write()
        writer = src.replicated_mask | sum(1 << j for j in plan.lane_axis)
        w = self.tid_bits([(j, i) for i, j in enumerate(plan.warp_axis)])
        shift = self.const(nw)

        def write(r):
            at = self.emit("or", (self.emit("shl", (self.index(plan.out, r), shift), i32), w), i32)
            self.emit("sstore", (at, self.emit("get", (part, r), dtype)), base=0)
        self.if_(self.owner(Layout((), tuple(None if writer >> j & 1 else 0 for j in range(len(src.tbits))), ())),
                 lambda: self.for_slots(plan.out, write))
        self.barrier()
        out = self.emit("alloc", (), dtype, n=plan.out.nslots)

        def read(r):
            base = self.emit("shl", (self.index(plan.out, r), shift), i32)
            acc = self.emit("sload", (base,), dtype, base=0)
            for k in range(1, 1 << nw):
                at = self.emit("or", (base, self.const(k)), i32)
                acc = self.emit(comb, (acc, self.emit("sload", (at,), dtype, base=0)), dtype)
            self.emit("set", (out, r, acc))
        self.for_slots(plan.out, read)
        self.dirty = True
        return out

    def op_dot(self, op: Op, args):
        a, b = (x if isinstance(x, Regs) else self.materialize(x) for x in args)
        (m, k), n = a.lay.shape, b.lay.shape[1]
        dt = a.arr.dtype
        kc = k
        while (m + n) * kc * itemsize(dt) > DOT_SMEM and kc > 1:
            kc //= 2
        lm, lk, lkc, ln = lay.log2(m), lay.log2(k), lay.log2(kc), lay.log2(n)
        b_at = -(-(m * kc * itemsize(dt)) // 16) * 16
        self.need_smem(b_at + kc * n * itemsize(dt))
        out_l = lay.canonical((m, n), self.T)
        acc_t = op.result.dtype  # fp32, or i32 for int8 operands
        out = self.emit("alloc", (), acc_t, n=out_l.nslots)
        self.for_slots(out_l, lambda r: self.emit("set", (out, r, self.const(0.0 if acc_t == fp32 else 0, acc_t))))
        for c in range(k // kc):
            self.before_write()
            # A [m, k] -> smem[m * kc + k % kc];  B [k, n] -> smem[b_at:][(k % kc) * n + n]
            self.stage(a, [(lkc + i, i) for i in range(lk - lkc)], c, kc < k,
                       [(i, i) for i in range(lkc)] + [(lk + i, lkc + i) for i in range(lm)], 0)
            self.stage(b, [(ln + lkc + i, i) for i in range(lk - lkc)], c, kc < k,
                       [(i, i) for i in range(ln + lkc)], b_at)
            self.barrier()

            def acc(r):
                e = self.index(out_l, r)
                row = self.bitmap(e, [(ln + i, lkc + i) for i in range(lm)])  # m * kc
                col = self.bitmap(e, [(i, i) for i in range(ln)])
                s = self.emit("var", (self.emit("get", (out, r), acc_t),), acc_t)

                def step(kk):
                    av = self.emit("sload", (self.emit("or", (row, kk), i32),), dt, base=0)
                    at = self.emit("or", (self.emit("shl", (kk, self.const(ln)), i32), col), i32)
                    bv = self.emit("sload", (at,), dt, base=b_at)
                    if dt != acc_t:
                        av, bv = (self.emit("cast", (v,), acc_t, to=acc_t) for v in (av, bv))
                    self.emit("assign", (s, self.emit("add", (s, self.emit("mul", (av, bv), acc_t)), acc_t)))
                self.loop(self.const(0), self.const(kc), step)
                self.emit("set", (out, r, s))
            self.for_slots(out_l, acc)
            self.dirty = True
        return Regs(out, out_l, ident(out_l))

    def stage(self, x: Regs, chunk_bits, c: int, chunked: bool, dst_bits, base: int) -> None:
        def write(r):
            e = self.index(x.lay, r)
            cond = self.emit("eq", (self.bitmap(e, chunk_bits), self.const(c)), bool_) if chunked else None
            v = self.at(x, x.lay, r)
            self.if_(cond, lambda: self.emit("sstore", (self.bitmap(e, dst_bits), v), base=base))
        self.if_(self.owner(x.lay), lambda: self.for_slots(x.lay, write))
