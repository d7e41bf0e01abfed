"""Paged attention in mlx ops, following the contract of `core.batch`.

The per-step metadata (which cache slots each sequence reads, masks) is computed once in numpy and
shared by every layer. Decodes (one query token) are batched into one padded attention call;
prefill chunks run one call each. Cache layout per layer: [num_slots, kv_heads, head_dim], where
slot = block * block_size + offset; one extra block at the end is scratch for padding writes. An 8-bit cache
(backends.mlx.kv_quant) is three arrays over the same slots, quantized as written and dequantized as gathered.
A latent layer (MLA) has a key cache only, its values being each key's first value_dim. A model of several KV
groups (core.kv_layout) gets one AttentionMeta per group, each over its own pool's tables and scratch slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backends.mlx import kv_quant
from backends.mlx.runtime import mx
from core.batch import Batch


def _bucket(n: int, minimum: int) -> int:
    """Round up to a power of two, so that shapes (and compiled graphs) repeat."""
    b = minimum
    while b < n:
        b *= 2
    return b


def decode_layout(tables: np.ndarray, ctx: np.ndarray, block_size: int, scratch: int, rows: int, width: int):
    """For sequences adding one token: the cache slot of each key index (scratch past the context), the
    block tables cut to `width` keys, and the context lengths; all padded to `rows` rows (context 0)."""
    n, j = len(ctx), np.arange(width)
    blocks = tables[:, np.minimum(j // block_size, tables.shape[1] - 1)]
    read = np.full((rows, width), scratch, np.int64)
    read[:n] = np.where(j[None] < ctx[:, None], blocks * block_size + j % block_size, scratch)
    bt = np.zeros((rows, width // block_size), np.int32)
    bt[:n, : tables.shape[1]] = np.maximum(tables[:, : width // block_size], 0)
    lens = np.zeros(rows, np.int32)
    lens[:n] = ctx
    return read.astype(np.int32), bt, lens


def decode_visible(ctx_lens: np.ndarray, width: int, window: int | None) -> np.ndarray:
    """Boolean mask [rows, 1, 1, width]: key j is visible to the query at cache index ctx-1."""
    j = np.arange(width)[None, :]
    last = ctx_lens[:, None].astype(np.int64) - 1
    ok = j <= last
    if window:
        ok &= j > last - window
    return ok[:, None, None, :]


@dataclass
class PrefillChunk:
    rows: tuple[int, int]  # flat token rows [start, end)
    kv_slots: mx.array  # [ctx] slots of cache indices 0..ctx-1
    positions: np.ndarray  # [q_len] cache index of each query token
    ctx: int


@dataclass
class AttentionMeta:
    slots: mx.array  # [T] write slots; padding goes to the scratch slot
    decode_rows: np.ndarray  # [Bd] flat row of each decode token
    decode_slots: mx.array | None  # [Bd_pad, L] slots to read
    decode_ctx: np.ndarray  # [Bd_pad] context length (padding rows: 0)
    prefills: list[PrefillChunk]
    order: mx.array | None  # inverse permutation from (decodes, prefills) back to batch rows
    num_tokens: int
    # For the DSL's paged decode kernel (Metal): block tables and context lengths of the decode rows.
    block_size: int = 0
    decode_tables: mx.array | None = None  # [Bd_pad, L / block_size]
    decode_ctx_lens: mx.array | None = None  # [Bd_pad]
    _masks: dict = field(default_factory=dict)

    @classmethod
    def from_batch(cls, batch: Batch, block_size: int, scratch_slot: int, group: int = 0) -> AttentionMeta:
        """The metadata of one KV group's layers (its tables, its pool's scratch slot)."""
        slot_mapping, block_tables = batch.kv_group(group)
        tables = block_tables.astype(np.int64)
        qs, ctx = batch.query_start, batch.context_lens
        q_lens = np.diff(qs)
        slots = np.where(slot_mapping < 0, scratch_slot, slot_mapping)
        dec = np.flatnonzero(q_lens == 1)
        pre = np.flatnonzero(q_lens > 1)

        def cache_slots(b: int, n: int) -> np.ndarray:
            j = np.arange(n)
            return tables[b, j // block_size] * block_size + j % block_size

        decode_slots, dctx, dtables = None, np.zeros(0, np.int32), None
        if len(dec):
            width = _bucket(int(ctx[dec].max()), block_size)
            read, bt, dctx = decode_layout(tables[dec], ctx[dec].astype(np.int64), block_size, scratch_slot,
                                           _bucket(len(dec), 1), width)
            decode_slots, dtables = mx.array(read), mx.array(bt)
        prefills = []
        for b in pre:
            n, q = int(ctx[b]), int(q_lens[b])
            prefills.append(PrefillChunk((int(qs[b]), int(qs[b + 1])), mx.array(cache_slots(b, n).astype(np.int32)),
                                         np.arange(n - q, n), n))
        rows = np.concatenate([qs[dec]] + [np.arange(*p.rows) for p in prefills]).astype(np.int64)
        order = None
        if len(rows) != batch.num_tokens or np.any(rows != np.arange(len(rows))):
            inv = np.empty(len(rows), np.int32)
            inv[rows] = np.arange(len(rows), dtype=np.int32)
            order = mx.array(inv)
        return cls(mx.array(slots.astype(np.int32)), qs[dec].astype(np.int64), decode_slots, dctx, prefills,
                   order, batch.num_tokens, block_size, dtables, mx.array(dctx) if len(dec) else None)

    def decode_mask(self, window: int | None) -> mx.array:
        """Boolean mask [Bd_pad, 1, 1, L] (see decode_visible)."""
        key = ("decode", window)
        if key not in self._masks:
            self._masks[key] = mx.array(decode_visible(self.decode_ctx, self.decode_slots.shape[1], window))
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> mx.array:
        key = ("prefill", i, window)
        if key not in self._masks:
            p = self.prefills[i]
            j = np.arange(p.ctx)[None, :]
            qi = p.positions[:, None]
            ok = j <= qi
            if window:
                ok &= j > qi - window
            self._masks[key] = mx.array(ok[None, None])
        return self._masks[key]


def _attend(q, k, v, mask, scale: float, softcap: float | None):
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D], boolean mask broadcastable to [B, Hq, Q, L]."""
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q @ k.transpose(0, 1, 3, 2)).astype(mx.float32) * scale
    s = mx.where(mask, softcap * mx.tanh(s / softcap), -mx.inf)
    return mx.softmax(s, axis=-1).astype(q.dtype) @ v


def paged_attention(q, k, v, kc, vc, meta: AttentionMeta, *, scale: float, sliding_window: int | None,
                    softcap: float | None, kernels=None):
    """Writes this step's k/v into the caches, then attends. Returns (out [T, Hq, Dv], kc, vc).
    With `kernels` (backends.mlx.metal_ops.KernelOps) decodes run the DSL's paged decode kernel."""
    kc, vc = kv_quant.write(kc, meta.slots, k), kv_quant.write(vc, meta.slots, v)
    return attend_paged(q, kc, vc, meta, scale=scale, sliding_window=sliding_window, softcap=softcap,
                        kernels=kernels), kc, vc


def latent_attention(q, kv, kc, meta: AttentionMeta, *, value_dim: int, scale: float, sliding_window: int | None,
                     softcap: float | None, kernels=None):
    """MLA over its latent cache: this step's latents kv [T, Hkv, D] written as keys, the values being the cached
    keys' first value_dim. Returns (out [T, Hq, value_dim], kc)."""
    kc = kv_quant.write(kc, meta.slots, kv)
    return attend_paged(q, kc, None, meta, scale=scale, sliding_window=sliding_window, softcap=softcap,
                        kernels=kernels, value_dim=value_dim), kc


def attend_paged(q, kc, vc, meta: AttentionMeta, *, scale: float, sliding_window: int | None, softcap: float | None,
                 kernels=None, value_dim: int | None = None):
    """Attention of q over caches already holding this step's keys and values; vc None: the values are kc's first
    value_dim (a latent cache). A cache may be a kv_quant.QuantizedCache, dequantized as it is read."""

    def values(keys, slots):
        return keys[..., :value_dim] if vc is None else kv_quant.read(vc, slots)

    parts = []
    if meta.decode_slots is not None:
        bd = meta.decode_slots.shape[0]
        if meta.decode_rows is None:  # the compiled decode step: rows are already the padded batch
            qd = q
        else:
            qd = q[mx.array(meta.decode_rows)]
            if qd.shape[0] < bd:
                qd = mx.pad(qd, [(0, bd - qd.shape[0]), (0, 0), (0, 0)])
        # The DSL's kernel reads float caches only: an 8-bit cache is read through mlx ops.
        if kernels is not None and meta.decode_tables is not None and not isinstance(kc, kv_quant.QuantizedCache):
            # The DSL's kernel reads values as wide as keys: a latent's whole width, its first value_dim kept.
            out = kernels.paged_decode(qd, kc, kc if vc is None else vc, meta.block_size, meta.decode_tables,
                                       meta.decode_ctx_lens, meta.decode_slots.shape[1], scale, sliding_window,
                                       softcap)
            out = out if vc is not None else out[..., :value_dim]
        else:
            keys = kv_quant.read(kc, meta.decode_slots)  # [Bd, L, Hkv, D]
            vals = values(keys, meta.decode_slots)
            out = _attend(qd[:, :, None, :], keys.transpose(0, 2, 1, 3), vals.transpose(0, 2, 1, 3),
                          meta.decode_mask(sliding_window), scale, softcap)[:, :, 0]
        parts.append(out if meta.decode_rows is None else out[: len(meta.decode_rows)])
    for i, p in enumerate(meta.prefills):
        qp = q[p.rows[0]: p.rows[1]].transpose(1, 0, 2)[None]
        keys = kv_quant.read(kc, p.kv_slots)
        vals = values(keys, p.kv_slots)
        out = _attend(qp, keys.transpose(1, 0, 2)[None], vals.transpose(1, 0, 2)[None],
                      meta.prefill_mask(i, sliding_window), scale, softcap)
        parts.append(out[0].transpose(1, 0, 2))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if meta.order is not None:
        out = out[meta.order]
    return out
