"""The CUDA runner's attention nodes (attention, rope_attention, latent_attention): this step's keys and values
written into the paged caches (rope fused into the write where it can be), then the paged decode or prefill kernel.

An eager decode step runs one of these a layer, so what a node needs beyond its inputs is looked up once: its
layer's caches, KV group and rope tables per node (again after Runner.set_cache or a new cache list), and the
decode's tile, partition and grid cap per batch size (again when the runner's decode table or reduce switch
changes)."""

from __future__ import annotations

import os
from typing import NamedTuple

from backends.cuda.runtime import torch
from backends.cuda.step_meta import StepMeta
from ir.graph import Node
from ir.rope import long_after
from kernels_src import kv_fp8, kv_int8, kv_write, paged_attention, paged_prefill, rope, rope_kv_write
from kernels_src.dsl import launch as dsl_launch
from kernels_src.dsl.launch import signature
from kernels_src.mla_decode import mla_decode
from kernels_src.paged_decode_rope import TARGETS as ROPE_DECODE_TARGETS

F = torch.nn.functional
ROPE_DECODE = os.environ.get("LLM_ENGINE_ROPE_DECODE", "1") != "0"  # "0": decode steps launch rope_kv_write first


class Layer(NamedTuple):
    caches: tuple  # (k, v), (k, v, k_scales, v_scales) of an 8-bit cache, or a latent layer's (cache,)
    group: int  # its KV group
    spec: object  # a rope_attention's RopeSpec, else None
    tables: tuple | None  # the spec's (cos, sin)
    interleaved: bool
    positions: bool  # the rope rows are the positions (not a longrope spec)


def layer(runner, node: Node) -> Layer:
    kv, rope_tables, known = runner.attention_layers
    if kv is not runner.kv or rope_tables is not runner._rope:  # a new cache (allocate_kv, set_cache)
        known = {}
        runner.attention_layers = (runner.kv, runner._rope, known)
    found = known.get(id(node))
    if found is None:
        a = node.attrs
        spec = a.get("spec")
        found = known[id(node)] = Layer(tuple(runner.kv[a["layer"]]), runner.group_of[a["layer"]], spec,
                                        runner._rope.get(spec), spec is not None and spec.style != "neox",
                                        spec is None or long_after(spec) is None)
    return found


def _rows(runner, lay: Layer, meta: StepMeta):
    return meta.positions if lay.positions else runner.rope_rows(lay.spec, meta)


def attention(runner, node: Node, args, meta: StepMeta):
    lay = layer(runner, node)
    if runner.step_arena is not None and meta.decode and _replayable(runner, node, lay, args):  # an eager decode's
        return _replay(runner, node, lay, args, meta)
    return _attention(runner, node, lay, args, meta)


class _Launches(NamedTuple):
    """A decode node's launches, as its last step made them (step_arena.memo)."""

    qkv: tuple  # its q, k, v then
    step: tuple  # what they depend on of the step's arrays (_step_arrays)
    qkv_sig: tuple  # q's, k's and v's shapes, strides and dtypes
    launches: list  # (BoundLaunch, its arguments, [(an argument's index, the step array it was)])
    out: object  # the output (a kept buffer)
    lay: Layer  # its caches and rope tables (remade for new ones)


def _replay(runner, node: Node, lay: Layer, args, meta: StepMeta):
    """The node's launches as its last step made them, this step's arrays swapped in, where they depend on nothing
    else that changed (a context a token longer: the same launches); else made again, and kept."""
    step, sig = _step_arrays(runner, meta, lay.group)
    q, k, v = args[:3]
    arrays = (*step, q, k, v)  # a wider step's q, k, v: views of a new projection each step (of the same strides)
    last = runner.step_arena.memo.get(id(node))
    if last is not None and last.step is sig and last.lay is lay and (
            last.qkv[0] is q and last.qkv[1] is k and last.qkv[2] is v or last.qkv_sig == signature(q, k, v)):
        for launch, kept, swaps in last.launches:
            a = list(kept)
            for i, j in swaps:
                a[i] = arrays[j]
            launch(*a)
        return last.out
    with dsl_launch.recording() as launches:
        out = _attention(runner, node, lay, args, meta)
    if runner.step_arena.holds(node.outs[0].id, out):  # (not past the arena's bytes)
        kept = [(f, a, [(i, j) for i, t in enumerate(a) for j, s in enumerate(arrays) if t is s]) for f, a in launches]
        runner.step_arena.memo[id(node)] = _Launches((q, k, v), sig, signature(q, k, v), kept, out, lay)
    return out


def _replayable(runner, node: Node, lay: Layer, args) -> bool:
    """Whether the node's decode is launches alone (the rope and KV write, the decode and its reduce), each a step
    the same but for the step's arrays (_step_arrays): a rope_attention over a 16-bit cache whose rope rows are the
    positions, q its own to rotate (no copy), values as wide as the cache, its output not a graph's output."""
    return node.op == "rope_attention" and len(lay.caches) == 2 and lay.positions and \
        node.inputs[0].id in runner._sole and args[2].shape[2] == lay.caches[1].shape[3] and \
        node.outs[0].id not in runner.step_arena.keep


def _step_arrays(runner, meta: StepMeta, group: int) -> tuple:
    """(this step's arrays a decode of KV group `group` reads: slots, positions, tables, lengths; what the launches
    made from them depend on: their shapes, strides and dtypes and the decode's partitions), the latter the same
    object while it is equal (a context a token longer: the same launches): worked out once a step, not a layer."""
    key, memo = ("attention", group), runner.step_arena.memo
    got = memo.get(key)
    if got is None or got[0] is not meta:
        slots, tables = meta.kv_group(group)
        arrays = (slots, meta.positions, tables, meta.context_lens)
        block_n, _, _, partition, max_parts = decode_settings(runner, meta.positions.shape[0])
        sig = (signature(*arrays), paged_attention.decode_grid(meta.max_context, partition, max_parts, block_n)[2])
        got = memo[key] = (meta, arrays, got[2] if got is not None and got[2] == sig else sig)
    return got[1], got[2]


def use_rope_decode(runner) -> bool:
    """Whether the runner's decode steps rotate and write the cache inside the decode kernel (Runner.rope_decode)."""
    if runner.rope_decode is None:
        return ROPE_DECODE and runner.target in ROPE_DECODE_TARGETS
    return runner.rope_decode


def _attention(runner, node: Node, lay: Layer, args, meta: StepMeta):
    kc, vc, *scales = lay.caches  # an int8 or fp8 cache also has (k_scales, v_scales)
    slots, tables = meta.kv_group(lay.group)
    q, k, v = args[:3]
    dv = v.shape[2]
    if node.op == "rope_attention" and meta.decode and not scales and dv == kc.shape[3] and use_rope_decode(runner):
        # one launch: the decode rotates q and k and writes k and v itself (q is not rotated in place)
        rope_in = (k, v, slots, _rows(runner, lay, meta), *lay.tables, lay.interleaved)
        return attend(runner, q, kc, vc, tables, meta, node.attrs, (), node.outs[0].id, rope=rope_in)
    if dv < kc.shape[3]:  # values narrower than keys, cached at the keys' width (CUDABackend.kv_layout)
        v = F.pad(v, (0, kc.shape[3] - dv))
    if scales:  # 8-bit: q and k rotated in place (rope_kv_write writes 16-bit caches), then the quantizing write
        if node.op == "rope_attention":
            q, k = runner._own(node.inputs[0], q), runner._own(node.inputs[1], k)
            rope.rope(q, k, _rows(runner, lay, meta), *lay.tables, interleaved=lay.interleaved,
                      target=runner.target, pdl=runner.pdl)
        write = kv_fp8.kv_write_fp8 if kc.dtype == torch.uint8 else kv_int8.kv_write_int8
        write(k, v, kc, vc, *scales, slots, target=runner.target, pdl=runner.pdl)
    elif node.op == "attention":
        kv_write.kv_write(k, v, kc, vc, slots, target=runner.target, pdl=runner.pdl)
    else:  # rope_attention: q rotated in place, k rotated on its way into the cache, one kernel
        q = runner._own(node.inputs[0], q)
        cos, sin = lay.tables
        rope_kv_write.rope_kv_write(q, k, v, kc, vc, slots, _rows(runner, lay, meta), cos, sin,
                                    interleaved=lay.interleaved, target=runner.target, pdl=runner.pdl)
    out = attend(runner, q, kc, vc, tables, meta, node.attrs, scales, node.outs[0].id)
    return out if out.shape[2] == dv else out[..., :dv]


def latent_attention(runner, node: Node, args, meta: StepMeta):
    """MLA over its latent cache. A decode step runs mla_decode (head groups over each latent tile, the values the
    tile's first value_dim). Prefill runs the paged kernels as attention of one KV head whose values are the same
    cache, keeping the output's first value_dim (the rope part's weighted sum is computed and dropped), as does a
    decode with a window or softcap, which mla_decode lacks (no MLA model has them). kv_write stores the latent as
    k and as v, both into the one cache: the same values twice to the same place, one copy kept."""
    a, lay = node.attrs, layer(runner, node)
    (cache,) = lay.caches
    slots, tables = meta.kv_group(lay.group)
    q, kv = args[:2]
    kv_write.kv_write(kv, kv, cache, cache, slots, target=runner.target, pdl=runner.pdl)
    if meta.decode and not a.get("sliding_window") and not a.get("softcap"):
        rows = q.shape[0]  # the grid as paged_decode's: fixed by max_context and the partition rules
        return mla_decode(q, cache, tables, meta.context_lens, a["scale"], a["value_dim"],
                          max_context=meta.max_context, partition=runner.decode_partition(rows),
                          max_parts=runner.max_partitions(rows), target=runner.target, pdl=runner._attend_pdl)
    return attend(runner, q, cache, cache, tables, meta, a)[..., :a["value_dim"]]


def decode_settings(runner, rows: int) -> tuple[int, int, bool, int, int]:
    """(BLOCK_N, num_warps, fused, partition, max_parts) of a decode of `rows` sequences."""
    table, fused_reduce, target, known = runner.decode_settings
    if table is not runner.decode or fused_reduce is not runner.fused_reduce or target != runner.target:
        known = {}  # a benchmark swapped them
        runner.decode_settings = (runner.decode, runner.fused_reduce, runner.target, known)
    found = known.get(rows)
    if found is None:
        found = known[rows] = (*runner.decode.tile(rows * runner.kv_heads),
                               paged_attention.use_fused_reduce(runner.target, runner.fused_reduce),
                               runner.decode_partition(rows), runner.max_partitions(rows))
    return found


def attend(runner, q, kc, vc, tables, meta: StepMeta, a: dict, scales=(), vid: int | None = None, rope=None):
    """The decode (split-K) or prefill kernel over caches already holding this step's keys and values (int8 codes
    or e4m3 bytes when `scales` holds their k and v scales); `vid`: the output's value id (its kept buffer, if any);
    `rope`: a decode's paged_decode `rope` (q unrotated, the keys and values not yet written)."""
    shape, arena = (q.shape[0], q.shape[1], vc.shape[3]), runner.step_arena
    out = q.new_empty(shape) if arena is None or vid is None else arena.take(vid, shape, q)
    if meta.decode:  # an eager decode's every layer: its keywords spelled out, no dict
        rows = q.shape[0]
        block_n, num_warps, fused, partition, max_parts = decode_settings(runner, rows)
        counters = runner.decode_counters(rows * kc.shape[2]) if fused else None
        k_scales, v_scales = scales if scales else (None, None)
        return paged_attention.paged_decode(q, kc, vc, tables, meta.context_lens, a["scale"],
                                            sliding_window=a.get("sliding_window"), softcap=a.get("softcap"), out=out,
                                            max_context=meta.max_context, partition=partition, max_parts=max_parts,
                                            block_n=block_n, num_warps=num_warps, k_scales=k_scales,
                                            v_scales=v_scales, target=runner.target, pdl=runner._attend_pdl,
                                            fused=fused, counters=counters, rope=rope,
                                            workspace=lambda parts: runner.decode_scratch(q, parts))
    kw = dict(sliding_window=a.get("sliding_window"), softcap=a.get("softcap"), out=out, target=runner.target,
              pdl=runner._attend_pdl)
    if scales:
        kw.update(k_scales=scales[0], v_scales=scales[1])
    if meta.tile_maps is not None:
        kw["tile_map"] = meta.tile_maps[paged_prefill.tile_key(q.shape[1], kc.shape[2], q.shape[2])]
    return paged_prefill.paged_prefill(q, kc, vc, tables, meta.context_lens, meta.query_start, a["scale"],
                                       max_query_len=meta.max_query_len, **kw)
