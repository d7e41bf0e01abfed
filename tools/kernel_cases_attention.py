"""The paged attention kernels' GPU cases (decode, its split-K reduce, prefill, MLA decode) for
tools/kernel_cases.py: caches through shuffled block tables with NaN outside every context, checked per sequence
against the numpy reference."""

from __future__ import annotations

import numpy as np

from kernels_src import mla_decode as md
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import elem_stride, tl
from tools.kernel_case_base import Case, Dev, Verdict, combine, compare, host, written

# --- paged attention ------------------------------------------------------------------------------------------------

def _paged_cache(d: Dev, p: dict, ctxs: np.ndarray):
    """Caches [blocks, bs, Hkv, D] through shuffled block tables; every slot outside the contexts holds NaN."""
    torch, bs, hkv, dim, dt = d.torch, p["block_size"], p["kv_heads"], p["head_dim"], d.dtype(p["dtype"])
    max_blocks = -(-int(ctxs.max()) // bs)
    n_blocks = len(ctxs) * max_blocks + 3
    tables = d.perm(n_blocks)[:len(ctxs) * max_blocks].view(len(ctxs), max_blocks).to(torch.int32)
    kc, vc = d.randn((n_blocks, bs, hkv, dim), dt), d.randn((n_blocks, bs, hkv, dim), dt)
    j = torch.arange(max_blocks * bs, device=d.dev)
    used_slots = (tables.long()[:, j // bs] * bs + j % bs)[j[None, :] < torch.from_numpy(ctxs).to(d.dev)[:, None]]
    unused = torch.ones(n_blocks * bs, dtype=torch.bool, device=d.dev)
    unused[used_slots] = False
    for c in (kc, vc):
        c.view(n_blocks * bs, -1)[unused] = float("nan")
    return kc, vc, tables


def _seq_cache(kc, vc, tables, b: int, n_ctx: int):
    """Sequence b's first n_ctx cache entries as a compact CPU cache with an identity block table."""
    n = -(-n_ctx // kc.shape[1])
    blocks = tables[b, :n].long()
    return host(kc[blocks]), host(vc[blocks]), np.arange(n, dtype=np.int32)[None, :]


def _check_seqs(n: int) -> list[int]:
    return list(range(n)) if n <= 6 else [0, 1, n // 2, n - 1]


def _decode_setup(d: Dev, p: dict):
    b, ctx, hq, dim, dt = p["batch"], p["context"], p["q_heads"], p["head_dim"], d.dtype(p["dtype"])
    ctxs = np.full(b, ctx, np.int32)
    if p.get("ragged"):
        ctxs = d.rng.integers(1, ctx + 1, b).astype(np.int32)
        ctxs[-1] = ctx
    kc, vc, tables = _paged_cache(d, p, ctxs)
    q = d.randn((b, hq + 2 * p["kv_heads"], dim), dt)[:, :hq]  # a strided view, as out of a qkv split
    n_parts = pa.num_partitions(ctx, 512)
    ws = pa.decode_workspace(q, n_parts) if n_parts > 1 else None
    return ctxs, kc, vc, tables, q, d.nan((b, hq, dim), dt), ws, n_parts, dim ** -0.5


def _decode_check(d, p, ctxs, kc, vc, tables, q, out, scale) -> Verdict:
    verdicts = [written("out", out)]
    for b in _check_seqs(len(ctxs)):
        kb, vb, tb = _seq_cache(kc, vc, tables, b, int(ctxs[b]))
        want = pa.paged_decode_ref(host(q[b:b + 1]), kb, vb, tb, ctxs[b:b + 1], scale)
        verdicts.append(compare(f"out[seq {b}]", host(out[b:b + 1]), want, p["dtype"]))
    return combine(*verdicts)


def paged_decode_case(d: Dev, p: dict) -> Case:
    ctxs, kc, vc, tables, q, out, ws, _, scale = _decode_setup(d, p)
    ctx_dev = d.torch.from_numpy(ctxs).to(d.dev)
    counters = pa.decode_counters(q, len(ctxs) * p["kv_heads"])  # Triton's: the last partition combines

    def launch(target):
        pa.paged_decode(q, kc, vc, tables, ctx_dev, scale, out=out, max_context=p["context"], workspace=ws,
                        target=target, counters=counters)

    return Case("paged_decode", p, launch, lambda: _decode_check(d, p, ctxs, kc, vc, tables, q, out, scale),
                lambda target: out.fill_(float("nan")))


def paged_decode_reduce_case(d: Dev, p: dict) -> Case:
    """The split-K reduce alone, over partials that the split decode kernel of the same target wrote."""
    ctxs, kc, vc, tables, q, out, ws, n_parts, scale = _decode_setup(d, p)
    if ws is None:
        raise ValueError(f"context {p['context']} fits one partition: no reduce runs")
    ctx_dev = d.torch.from_numpy(ctxs).to(d.dev)
    bd = max(16, tl.next_power_of_2(p["head_dim"]))

    def prepare(target):
        pa.paged_decode(q, kc, vc, tables, ctx_dev, scale, out=out, max_context=p["context"], workspace=ws,
                        target=target)
        out.fill_(float("nan"))

    def launch(target):
        red = dsl_compile(pa.paged_decode_reduce_kernel, target, HEAD_DIM=p["head_dim"], BLOCK_D=bd, PARTITION=512,
                          BLOCK_N=64, BLOCK_P=pa.reduce_block(n_parts, bd))
        red[len(ctxs), p["q_heads"]](*ws, ctx_dev, out, n_parts, elem_stride(out, 0), elem_stride(out, 1))

    return Case("paged_decode_reduce", p, launch,
                lambda: _decode_check(d, p, ctxs, kc, vc, tables, q, out, scale), prepare)


def paged_prefill_case(d: Dev, p: dict) -> Case:
    s, ql, ctx, hq, dim, dt = p["seqs"], p["query_len"], p["context"], p["q_heads"], p["head_dim"], d.dtype(p["dtype"])
    q_lens = np.full(s, ql, np.int32)
    ctxs = np.full(s, ctx, np.int32)
    if p.get("ragged"):  # a sequence with nothing new, short chunks, fresh prompts and long cached prefixes
        q_lens = d.rng.integers(0, ql + 1, s).astype(np.int32)
        ctxs = (q_lens + d.rng.integers(0, ctx - ql + 1, s)).astype(np.int32)
        q_lens[0], ctxs[0] = ql, ctx
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kc, vc, tables = _paged_cache(d, p, ctxs)
    q, out, scale = d.randn((int(qs[-1]), hq, dim), dt), d.nan((int(qs[-1]), hq, dim), dt), dim ** -0.5
    ctx_dev, qs_dev = (d.torch.from_numpy(a).to(d.dev) for a in (ctxs, qs))

    def launch(target):
        pp.paged_prefill(q, kc, vc, tables, ctx_dev, qs_dev, scale, out=out, max_query_len=ql, target=target)

    def check():
        verdicts = [written("out", out)]
        for b in sorted({0, s // 2, s - 1}) if s > 4 else range(s):  # the first and last 32 queries of each
            n = int(q_lens[b])
            for i0, i1 in sorted({(0, min(32, n)), (max(0, n - 32), n)}):
                if i1 <= i0:
                    continue
                c1 = int(ctxs[b]) - n + i1  # queries i0..i1 are the last of a context ending at query i1
                kb, vb, tb = _seq_cache(kc, vc, tables, b, c1)
                rows = slice(int(qs[b]) + i0, int(qs[b]) + i1)
                want = pa.paged_attention_ref(host(q[rows]), kb, vb, tb, np.array([c1]), np.array([0, i1 - i0]),
                                              scale)
                verdicts.append(compare(f"out[seq {b}, q {i0}:{i1}]", host(out[rows]), want, p["dtype"]))
        return combine(*verdicts)

    return Case("paged_prefill", p, launch, check, lambda target: out.fill_(float("nan")))


def mla_decode_case(d: Dev, p: dict) -> Case:
    """DeepSeek's latent cache ([blocks, bs, 1, rank + rope], NaN outside the contexts) under absorbed queries."""
    b, ctx, heads, rank, rope, dt = p["batch"], p["context"], p["heads"], p["rank"], p["rope"], d.dtype(p["dtype"])
    ctxs = np.full(b, ctx, np.int32)
    if p.get("ragged"):
        ctxs = d.rng.integers(1, ctx + 1, b).astype(np.int32)
        ctxs[-1] = ctx
    cache, _, tables = _paged_cache(d, p | dict(kv_heads=1, head_dim=rank + rope), ctxs)
    q = d.randn((b, heads + 1, rank + rope), dt)[:, :heads]  # a strided view of heads
    out, scale = d.nan((b, heads, rank), dt), (128 + rope) ** -0.5  # V3's qk_head_dim
    n_parts = pa.num_partitions(ctx, 512)
    ws = md.mla_workspace(q, rank, n_parts) if n_parts > 1 else None
    ctx_dev = d.torch.from_numpy(ctxs).to(d.dev)

    def launch(target):
        md.mla_decode(q, cache, tables, ctx_dev, scale, rank, out=out, max_context=ctx, workspace=ws, target=target)

    def check():
        verdicts = [written("out", out)]
        for s in _check_seqs(b):
            kb, _, tb = _seq_cache(cache, cache, tables, s, int(ctxs[s]))
            want = md.mla_decode_ref(host(q[s:s + 1]), kb, tb, ctxs[s:s + 1], scale, rank)
            verdicts.append(compare(f"out[seq {s}]", host(out[s:s + 1]), want, p["dtype"]))
        return combine(*verdicts)

    return Case("mla_decode", p, launch, check, lambda target: out.fill_(float("nan")))
