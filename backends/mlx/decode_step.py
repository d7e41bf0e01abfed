"""The decode step compiled with `mx.compile`: fused elementwise work and no per-op graph building.

Only batches where every sequence adds one token take this path. Batch size and context width are
rounded up to powers of two (padding rows write to the scratch slot and read nothing), so a server
sees a handful of shapes and `mx.compile` traces each once. Inputs and outputs are plain arrays:
the K/V caches go in and come back, and because the backend drops its own references first, MLX
updates them in place. Each KV group (core.kv_layout) brings its own slots and tables.
"""

from __future__ import annotations

import numpy as np

from backends.mlx.attention import AttentionMeta, _bucket, decode_layout, decode_visible
from backends.mlx.lower import GraphRunner, StepContext
from backends.mlx.runtime import mx
from core.batch import Batch
from ir.kv_groups import kv_layout
from ir.rope import RopeSpec, cos_sin

# Contexts shorter than this share one compiled shape: padding keys costs far less than a retrace.
MIN_WIDTH = 256


class PreparedContext(StepContext):
    """A StepContext whose rope tables and masks arrive as (traced) arrays."""

    def __init__(self, meta: AttentionMeta, rope: dict[RopeSpec, tuple[mx.array, mx.array]]):
        self.meta = meta
        self._rope = rope


class CompiledDecode:
    def __init__(self, runner: GraphRunner, dtype):
        self.runner = runner
        self.dtype = dtype
        self.specs = sorted(runner.graph.rope_specs(), key=str)
        self.windows = sorted({n.attrs.get("sliding_window") for n in runner.graph.attention_nodes()},
                              key=lambda w: -1 if w is None else w)
        layout = kv_layout(runner.graph)
        self.num_groups, self.group_of = layout.num_groups, layout.group_of
        # Arrays per layer: a latent has one cache, others two; an 8-bit cache is three arrays (backends.mlx.kv_quant).
        self.arity = [(1 if s.values_in_keys else 2) * (3 if runner.kv_int8 else 1) for s in layout.shapes]
        self._fn = mx.compile(self._step)

    @staticmethod
    def applies(batch: Batch) -> bool:
        return batch.is_decode

    def _step(self, tokens, rows, ctx_lens, *rest):
        n_kv = 3 * self.num_groups  # each KV group's (write slots, read slots, block tables)
        n_rope = 2 * len(self.specs)
        rope = {s: (rest[n_kv + 2 * i], rest[n_kv + 2 * i + 1]) for i, s in enumerate(self.specs)}
        masks = rest[n_kv + n_rope: n_kv + n_rope + len(self.windows)]
        flat_kv = rest[n_kv + n_rope + len(self.windows):]
        shared_masks = {("decode", w): m for w, m in zip(self.windows, masks, strict=True)}
        metas = []
        for g in range(self.num_groups):
            slots, read_slots, tables = rest[3 * g: 3 * g + 3]
            meta = AttentionMeta(slots, None, read_slots, None, [], None, tokens.shape[0], self.block_size, tables,
                                 ctx_lens)
            meta._masks = shared_masks  # a mask depends on the contexts and the window only
            metas.append(meta)
        ctx = PreparedContext(metas[0], rope)
        if self.num_groups > 1:
            ctx.group_metas, ctx.group_of = metas, self.group_of
        kv = self._layers(flat_kv)
        out = self.runner.run({"token_ids": tokens, "logits_indices": rows}, ctx, kv)
        return [out["logits"].astype(mx.float32)] + [a for layer in kv for a in layer]

    def _layers(self, flat: list) -> list[list]:
        """The caches of each layer out of one flat list."""
        ends = np.cumsum(self.arity)
        return [list(flat[e - n:e]) for n, e in zip(self.arity, ends, strict=True)]

    def __call__(self, batch: Batch, kv: list[list[mx.array]], block_size: int, scratch: list[int]):
        """`scratch`: each KV group's scratch slot (where padding rows write and past-the-context keys are read)."""
        self.block_size = block_size
        b = batch.num_tokens
        bp = _bucket(b, 1)
        ctx = batch.context_lens.astype(np.int64)
        width = _bucket(int(ctx.max()), max(block_size, MIN_WIDTH))
        pad = lambda a, fill: np.concatenate([a, np.full(bp - b, fill, a.dtype)])  # noqa: E731
        groups = []
        for g in range(self.num_groups):
            slot_mapping, tables = batch.kv_group(g)
            read, btables, lens = decode_layout(tables.astype(np.int64), ctx, block_size, scratch[g], bp, width)
            slots = np.where(slot_mapping < 0, scratch[g], slot_mapping)
            groups += [mx.array(pad(slots, scratch[g]).astype(np.int32)), mx.array(read), mx.array(btables)]
        masks = [mx.array(decode_visible(lens, width, w)) for w in self.windows]
        positions = pad(batch.positions, 0)
        seq_lens = pad(batch.context_lens, 0)  # one token a sequence: its length picks longrope's table
        rope = []
        for spec in self.specs:
            cos, sin = cos_sin(spec, positions, seq_lens)
            rope += [mx.array(cos[:, None, :]).astype(self.dtype), mx.array(sin[:, None, :]).astype(self.dtype)]
        flat = [a for layer in kv for a in layer]
        kv.clear()  # our references must go, or MLX copies each cache instead of updating it in place
        try:
            outs = self._fn(mx.array(pad(batch.token_ids, 0)), mx.arange(bp, dtype=mx.int32), mx.array(lens),
                            *groups, *rope, *masks, *flat)
        except BaseException:
            # The caches are untouched (MLX is lazy, nothing ran): hand them back, or every later step fails too.
            kv.extend(self._layers(flat))
            raise
        del flat
        kv.extend(self._layers(outs[1:]))
        return outs[0][mx.array(batch.logits_indices)]
