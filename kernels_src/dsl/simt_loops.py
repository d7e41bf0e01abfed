"""The SIMT lowering of runtime loops (`for` with carried values): C loops over carried variables and register
arrays, whose layouts are settled before the body is emitted (see simt.py for the forms values take)."""

from __future__ import annotations

from . import layout as lay
from .ir import Block, Op, TileType, Value, i32
from .layout import Layout
from .simt import Lowering, Ptr, Regs, Uni


def ident(layout: Layout) -> tuple:
    return tuple(range(len(layout.rbits)))


class LoopLowering(Lowering):
    def op_for(self, op: Op, args):
        lo, hi, *init = args
        iv, *carried = op.body.args
        if any(isinstance(i, Ptr) for i in init):
            raise NotImplementedError("SIMT lowering: loop-carried pointers (carry an integer offset instead)")
        lays = self.loop_layouts(op, carried, init)
        store = []
        for c, i, layout in zip(carried, init, lays, strict=True):
            if layout is None:
                store.append(Uni(self.emit("var", (i.v,), c.dtype)))
            else:
                store.append(self.copy(i, layout, c.dtype))
        loop = self.emit("loop", (lo.v, hi.v), step=op.attrs["step"], unroll=False)
        iv_v = self.value(TileType(i32), None)
        iv_v.block = self.nested(loop, [iv_v])
        self.run_in(loop.body, lambda: self.loop_body(op, iv_v, store, lays))
        self.dirty = True
        for r, s in zip(op.results, store, strict=True):
            self.env[r.id] = s

    def loop_layouts(self, op: Op, carried, init) -> list:
        """Layouts of the carried tiles: a fixpoint of the layouts the body yields them in, found by dry runs.
        A tile's seed is its initial value itself (a constant init then takes the body's layout) or its canonical
        layout; the seeds are searched tile by tile for the fewest elements moved through threadgroup memory."""
        tiles = [k for k, c in enumerate(carried) if c.shape]
        canon = {k: lay.canonical(carried[k].shape, self.T) for k in tiles}

        def settle(from_init: frozenset):
            lays = {k: "init" if k in from_init else canon[k] for k in tiles}
            for _ in range(5):
                ys, cost = self.dry_run(op, lays, init)
                new = {k: ys[k].lay if isinstance(ys[k], Regs) else canon[k] if lays[k] == "init" else lays[k]
                       for k in tiles}
                if new == lays:
                    break
                lays = new
            return cost, sorted(from_init), lays

        best = min(settle(frozenset(tiles)), settle(frozenset()))
        for k in tiles * 2:
            best = min(best, settle(frozenset(best[1]) ^ {k}))
        return [best[2].get(k) for k in range(len(carried))]

    def bind(self, op: Op, iv: Value, store) -> None:
        self.env[op.body.args[0].id] = Uni(iv)
        for c, s in zip(op.body.args[1:], store, strict=True):
            self.env[c.id] = s

    def loop_body(self, op: Op, iv: Value, store, lays) -> None:
        self.dirty = True  # the previous iteration may have left threadgroup memory being read
        self.bind(op, iv, store)
        self.lower_block(op.body)
        arrays = {s.arr.id for s in store if isinstance(s, Regs)}
        scalars = {s.v.id for s in store if isinstance(s, Uni)}
        ys = []
        for y, layout in zip((self.env[y.id] for y in op.body.yields), lays, strict=True):
            if layout is None:
                ys.append(self.emit("var", (y.v,), y.v.dtype) if y.v.id in scalars else y.v)
            elif isinstance(y, Regs) and y.arr.id in arrays:
                ys.append(self.copy(y, layout, y.arr.dtype))
            else:
                ys.append(self.adapt(y, layout))
        for y, s, layout in zip(ys, store, lays, strict=True):
            if layout is None:
                self.emit("assign", (s.v, y))
            else:
                self.for_slots(layout, lambda r, s=s, y=y, layout=layout: self.emit(
                    "set", (s.arr, r, self.at(y, layout, r))))

    def copy(self, info, layout: Layout, dtype) -> Regs:
        src = self.adapt(info, layout)
        out = self.emit("alloc", (), dtype, n=layout.nslots)
        self.for_slots(layout, lambda r: self.emit("set", (out, r, self.at(src, layout, r))))
        return Regs(out, layout, ident(layout))

    def dry_run(self, op: Op, lays, init) -> list:
        """Lower the body once into a scratch block to learn the layouts its yields come out in."""
        saved = (self.block, len(self.pro.ops), self.dirty, dict(self.scopes[0]), self.smem_bytes)
        self.block = Block(None)
        self.scopes.append({})
        try:
            store = []
            for k, (c, i) in enumerate(zip(op.body.args[1:], init, strict=True)):
                layout = lays.get(k)
                if layout == "init":
                    store.append(i)
                elif layout is None:
                    store.append(Uni(self.value(c.type, None)))
                else:
                    store.append(Regs(self.emit("alloc", (), c.dtype, n=layout.nslots), layout, ident(layout)))
            self.bind(op, self.value(TileType(i32), None), store)
            moved = self.moved_total
            self.lower_block(op.body)
            ys = [self.env[y.id] for y in op.body.yields]
            cost = self.moved_total - moved + sum(self.moved(ys[k], lk) for k, lk in lays.items()
                                                  if isinstance(ys[k], Regs) and isinstance(lk, Layout))
            return ys, cost
        finally:
            self.scopes.pop()
            self.block, npro, self.dirty, scope0, self.smem_bytes = saved
            del self.pro.ops[npro:]
            self.scopes[0] = scope0
