"""Paged decode attention on a GPU, one layer of a model's shape (--shape: Llama-3-8B's 32 q heads, 8 KV heads,
head dim 128 by default; phi-3-mini's 32 KV heads of 96; bf16, 16-token blocks through shuffled block tables):
its time at each (batch, context) under the settings the CUDA backend picks (backends/cuda/decode_table.py) and
under a sweep of keys per partition, the grid's partition cap, BLOCK_N and num_warps, as a share of the copy
bandwidth (the keys and values read once).

Times are CUDA-graph replays (the launches' host cost left out, as the backend's decode graphs do). Cold by default:
successive calls read different copies of the caches and block tables, enough that none is still in L2, as each of
the engine's layers finds its KV (--hot: one copy, replayed from L2 where it fits). The grid is the engine's: the
context's partitions rounded up to a power of two, within the cap (backends/cuda/graphs.py). Every setting is first
compiled and checked against the reference on a small case in worker processes (they fill Triton's cache), so the
timing pass only replays. The last lines give the best setting per (batch, context), one setting per batch as
DecodeTable rows, and the tools/bench_gpu --decode-table that A/Bs it in the engine.

`--kv-cache-dtype fp8` times the fp8 cache's kernel (e4m3 bytes and a scale a token and head, kernels_src/kv_fp8.py)
on the same problems, its copy share counted on the bytes it reads; V's codes token-minor as the backend stores them
(LLM_ENGINE_FP8_V_TOKEN_MINOR=0: token-major, for the A/B). Split grids combine their partials in the
decode's last partition (kernels_src/decode_combine.py) with LLM_ENGINE_FUSED_REDUCE=1, and by the reduce kernel
without it (the default), for an A/B.

    python -m tools.bench_decode_attention [--shape llama3-8b|phi3-mini|gemma2-9b] [--batches 1,16,64]
        [--contexts 4096,16384,32768] [--kv-cache-dtype auto|fp8] [--hot] [--budget 100] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from backends.cuda.decode_table import DecodeTable, for_cache, pow2
from kernels_src import paged_attention as pa
from kernels_src.kv_fp8 import V_TOKEN_MINOR, token_minor

# (q heads, KV heads, head dim) of a layer; the workers (spawned) read the choice from the environment
SHAPES = {"llama3-8b": (32, 8, 128), "phi3-mini": (32, 32, 96), "gemma2-9b": (16, 8, 256)}
SHAPE_ENV = "BENCH_DECODE_ATTENTION_SHAPE"
Q_HEADS, KV_HEADS, HEAD_DIM = SHAPES[os.environ.get(SHAPE_ENV, "llama3-8b")]
KV_ENV = "BENCH_DECODE_ATTENTION_KV"  # "fp8": the workers build and check fp8 caches too
BLOCK = 16
SCALE = HEAD_DIM ** -0.5
PARTITIONS = (64, 128, 256, 512)
MAX_PARTS = (4, 8, 16, 32, 64, 128)
BLOCK_NS = (32, 64, 128)  # those that divide the partition
WARPS = (4, 8)
REP_MS = 5  # each setting: 10 replays of a graph of this many ms of calls (triton.testing.do_bench_cudagraph)
COLD_L2S = 3  # cold mode: the copies hold this many times the L2


def use_shape(name: str) -> None:
    """Time `name`'s layer here and in the workers spawned after this."""
    global Q_HEADS, KV_HEADS, HEAD_DIM, SCALE
    os.environ[SHAPE_ENV] = name
    Q_HEADS, KV_HEADS, HEAD_DIM = SHAPES[name]
    SCALE = HEAD_DIM ** -0.5


@dataclass(frozen=True)
class Setting:
    partition: int  # keys per split-K partition, below the cap
    max_parts: int  # the grid's partitions at most (longer contexts get longer partitions)
    block_n: int
    num_warps: int

    def grid(self, context: int) -> tuple[int, int]:
        """(partitions, keys per partition) at `context`: the engine's grid, and the kernel's partition_len."""
        n = min(pow2(pa.num_partitions(context, self.partition)), self.max_parts)
        return n, max(self.partition, -(-context // (n * self.block_n)) * self.block_n)

    def short(self) -> str:
        return f"{self.partition} keys, cap {self.max_parts}, {self.block_n}x{self.num_warps}"


def ours(batch: int, sms: int, table: DecodeTable | None = None) -> Setting:
    """The runner's setting at `batch`: its table for the cache being timed (decode_table.for_cache), or `table`."""
    table, programs = table or for_cache("fp8" if fp8() else None), batch * KV_HEADS
    return Setting(table.partition(programs), table.grid_cap(programs, sms), *table.tile(programs))


def settings(mine: Setting) -> list[Setting]:
    """Ours first, then the sweep."""
    sweep = [Setting(p, m, bn, nw) for p, m, bn, nw in itertools.product(PARTITIONS, MAX_PARTS, BLOCK_NS, WARPS)
             if p % bn == 0]
    return [mine] + [s for s in sweep if s != mine]


def plan(context: int, mine: Setting, sweep: bool = True) -> dict[tuple, Setting]:
    """The distinct runs at `context`, (partitions, keys per partition, BLOCK_N, warps) -> the first setting that
    gives it (ours first): settings whose cap or partition size does not bind there run the same grid. sweep=False:
    ours alone."""
    out: dict[tuple, Setting] = {}
    for s in settings(mine) if sweep else [mine]:
        out.setdefault((*s.grid(context), s.block_n, s.num_warps), s)
    return out


def fp8() -> bool:
    return os.environ.get(KV_ENV) == "fp8"


def fp8_label() -> str:
    """The fp8 cache and how its kernel decodes e4m3 (the cvt by default; integer ops with LLM_ENGINE_FP8_CVT=0)."""
    from kernels_src import e4m3

    return f"fp8 (e4m3 by {'the cvt' if e4m3.use_cvt('triton') else 'integer ops'})"


def combine_label() -> str:
    """How the timed kernels combine split-K partials (kernels_src/decode_combine.py)."""
    if pa.use_fused_reduce("triton"):
        return "in the decode's last partition (LLM_ENGINE_FUSED_REDUCE=1)"
    return "by the reduce kernel (LLM_ENGINE_FUSED_REDUCE=1: in the decode's last partition)"


def kv_bytes(batch: int, context: int) -> int:
    """K and V read once: bf16, or (fp8) a byte an element and an fp32 scale a token and head."""
    return 2 * batch * context * KV_HEADS * (HEAD_DIM + 4 if fp8() else HEAD_DIM * 2)


def e4m3_cache(torch, x):
    """(e4m3 bytes, fp32 scales per token and head) of a bf16 cache, by torch's cast (kernels_src/kv_fp8.py's rule)."""
    scales = x.float().abs().amax(-1).clamp_min(1e-30) / 448
    return (x.float() / scales[..., None]).to(torch.float8_e4m3fn).view(torch.uint8), scales


def caches(torch, batch: int, context: int, gen):
    """(k, v, tables): the contexts' blocks in a shuffled order; table rows padded to a multiple of 16 entries (the
    workers' tables too: Triton specializes kernels on the divisibility of the row stride)."""
    blocks = -(-context // BLOCK)
    kc = torch.randn((batch * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda",
                     generator=gen)
    tables = torch.zeros((batch, -(-blocks // 16) * 16), dtype=torch.int32, device="cuda")
    tables[:, :blocks] = torch.randperm(batch * blocks, device="cuda", generator=gen).view(batch, -1)
    vc = torch.randn_like(kc)
    if fp8():
        (kc, ks), (vc, vs) = e4m3_cache(torch, kc), e4m3_cache(torch, vc)
        return kc, token_minor(vc) if V_TOKEN_MINOR else vc, tables, (ks, vs)  # the backend's V layout
    return kc, vc, tables, ()


def problem(torch, batch: int, context: int, copies: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((batch, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda", generator=gen)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, ctx, [caches(torch, batch, context, gen) for _ in range(copies)]


def launch(prob, s: Setting, n: int, out, ws, turn, counters=None) -> None:
    q, ctx, _ = prob
    kc, vc, tables, scales = next(turn)  # each captured call its own copy
    kw = dict(k_scales=scales[0], v_scales=scales[1]) if scales else {}
    pa.paged_decode(q, kc, vc, tables, ctx, SCALE, out=out, max_context=n * s.partition, partition=s.partition,
                    max_parts=n, block_n=s.block_n, num_warps=s.num_warps, workspace=ws, target="triton",
                    counters=counters, **kw)


def time_setting(torch, triton, prob, s: Setting, context: int) -> float:
    """Seconds per call (decode + reduce, or the decode that combines in its last partition), from CUDA-graph
    replays cycling over the problem's copies."""
    n, _ = s.grid(context)
    out = torch.empty_like(prob[0])
    ws = pa.decode_workspace(prob[0], n) if n > 1 else None
    counters = pa.decode_counters(prob[0], prob[0].shape[0] * KV_HEADS)  # zeroed once, outside the graph
    turn = itertools.cycle(prob[2])
    ms = triton.testing.do_bench_cudagraph(lambda: launch(prob, s, n, out, ws, turn, counters), rep=REP_MS,
                                           return_mode="median")
    return ms / 1e3


def _check(job: tuple[Setting, int]) -> str | None:
    """Compile (into Triton's cache) and check one setting at one grid size on a small case: None, or what was
    wrong. Shapes, strides and the grid's partitions as in the timed runs: Triton specializes on them."""
    try:
        import numpy as np
        import torch

        s, n = job
        lens = [1, 777, min(n * s.partition + 333, 6000)]  # the last past the grid where the grid is small
        q, _, [cache] = problem(torch, len(lens), max(lens), 1)
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = torch.full_like(q, float("nan"))
        launch((q, ctx, None), s, n, out, pa.decode_workspace(q, n) if n > 1 else None, iter([cache]))
        host = lambda t: t.float().cpu().numpy()  # noqa: E731
        kc, vc, tables, scales = cache
        if scales:
            from kernels_src.kv_fp8 import dequantize_ref

            kc, vc = (torch.from_numpy(dequantize_ref(c.cpu().numpy(), x.cpu().numpy())) for c, x in
                      zip((kc, vc), scales, strict=True))
        want = pa.paged_decode_ref(host(q), host(kc), host(vc), tables.cpu().numpy(), np.array(lens), SCALE)
        err = np.abs(host(out) - want)
        return None if np.all(err <= 2e-2 + 2e-2 * np.abs(want)) else f"max |d out| {np.nanmax(err):.3g}"
    except Exception as e:  # noqa: BLE001 - a setting that fails to build or run is reported, the rest go on
        return f"{type(e).__name__}: {str(e)[:300]}"


def per_batch(rows: list[dict], batch: int, mine: Setting, cap: int | None = None) -> tuple | None:
    """The one setting (of partition cap `cap`, if given) whose worst ratio to each context's best is least at
    `batch`, among those timed at every context: (it, that ratio, ours'), or None if none was."""
    at = [r for r in rows if r["batch"] == batch]
    worst = {}
    for s in settings(mine):
        times = [r["times"].get((*s.grid(r["context"]), s.block_n, s.num_warps)) for r in at]
        if at and all(times) and cap in (None, s.max_parts):
            worst[s] = max(t / min(r["times"].values()) for t, r in zip(times, at, strict=True))
    if not worst:
        return None
    best = min(worst, key=worst.get)
    return best, worst[best], worst.get(mine, float("nan"))


def report(rows: list[dict], batches: list[int], sms: int) -> None:
    print("\n| batch | context | ours: partition/cap/tile | us | of copy | best | us | of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl, o, b = r["floor_us"], r["ours"], r["best"]
        print(f"| {r['batch']} | {r['context']} | {o.short()} | {r['ours_us']:.1f} | {fl / r['ours_us']:.0%} "
              f"| {b.short()} | {r['best_us']:.1f} | {fl / r['best_us']:.0%} |")
    print("\n# best per (batch, context): Setting(keys per partition, partition cap, BLOCK_N, num_warps)")
    print("BEST_DECODE = {")
    for r in rows:
        print(f"    ({r['batch']}, {r['context']}): {r['best']!r},  # {r['best_us']:.1f} us; ours {r['ours']!r} "
              f"{r['ours_us']:.1f} us")
    print("}")
    # The table sets keys per partition and the tile by batch; the cap follows the batch (DecodeTable.grid_cap), so
    # the rows keep the runner's cap, and the best under any cap is shown beside them.
    chosen = {b: c for b in sorted(batches) if (c := per_batch(rows, b, ours(b, sms), ours(b, sms).max_parts))}
    print("\n# one setting per batch (the least worst ratio to each context's best), at the runner's cap")
    for b, (s, worst, mine) in chosen.items():
        free, free_worst, _ = per_batch(rows, b, ours(b, sms))
        print(f"#   batch {b} ({b * KV_HEADS} programs): {s.short()}: within {worst - 1:.0%} of every context's best; "
              f"ours ({ours(b, sms).short()}) within {mine - 1:.0%}; under any cap {free.short()} within "
              f"{free_worst - 1:.0%}")
    if not chosen:
        return
    table = DecodeTable(partitions=tuple((b * KV_HEADS, s.partition) for b, (s, _, _) in chosen.items()),
                        tiles=tuple((b * KV_HEADS, s.block_n, s.num_warps) for b, (s, _, _) in chosen.items()))
    print("# backends/cuda/decode_table.py (past the last row: its LONG_PARTITION and DECODE_TILE; the cap: "
          "min(MAX_PARTITIONS, WAVES programs a SM))")
    print(f"DECODE_PARTITIONS = {table.partitions!r}  # (programs up to, keys per split-K partition)")
    print(f"DECODE_TILES = {table.tiles!r}  # (programs up to, BLOCK_N, num_warps)")
    print(f"# engine A/B: python -m tools.bench_gpu --decode-table '{table.spec()}' --ablations none --ablate ...")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help=f"the layer's heads (default: ${SHAPE_ENV} or llama3-8b)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="the caches' elements: "
                    "bf16 (auto) or e4m3 with a scale a token and head (fp8)")
    ap.add_argument("--hot", action="store_true", help="one copy of the caches, replayed from L2 where it fits")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds; past it only our setting is timed (0: "
                    "only ours, nothing else compiled: an A/B of a switch)")
    ap.add_argument("--trace", action="store_true", help="print each setting before timing it (with "
                    "CUDA_LAUNCH_BLOCKING=1: which one faults)")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_decode_attention.json")
    args = ap.parse_args()
    if args.shape:
        use_shape(args.shape)
    os.environ[KV_ENV] = args.kv_cache_dtype
    t0 = time.perf_counter()
    import torch
    import triton.testing

    from tools.bench_kernels import copy_gbps

    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = {(b, c): plan(c, ours(b, sms), sweep=args.budget > 0) for b, c in itertools.product(batches, contexts)}
    jobs = sorted({(s, k[0]) for p in plans.values() for k, s in p.items()}, key=repr)
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        wrong = {job: why for job, why in zip(jobs, pool.map(_check, jobs), strict=True) if why}
    runs = sum(map(len, plans.values()))
    print(f"compiled and checked {len(jobs)} (setting, grid) jobs in {time.perf_counter() - t0:.0f} s; {runs} runs "
          f"to time", flush=True)
    bw = copy_gbps(torch, 2**30) * 1e9
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    print(f"{os.environ.get(SHAPE_ENV, 'llama3-8b')} layer ({Q_HEADS} q heads, {KV_HEADS} KV heads of {HEAD_DIM}, "
          f"{fp8_label() if fp8() else 'bf16'} cache); copy {bw / 1e9:,.0f} GB/s, {sms} SMs, L2 {l2 >> 20} MiB; "
          f"{'hot' if args.hot else 'cold'} caches; split-K partials combined {combine_label()}", flush=True)
    rows, skipped = [], 0
    for (batch, context), runs_at in plans.items():
        copies = 1 if args.hot else max(2, -(-COLD_L2S * l2 // kv_bytes(batch, context)))
        prob = problem(torch, batch, context, copies)
        mine = ours(batch, sms)
        times = {}
        for key, s in runs_at.items():  # ours first
            if (s, key[0]) in wrong:
                continue
            if s != mine and time.perf_counter() - t0 > args.budget:
                skipped += 1
                continue
            if args.trace:
                print(f"  timing {s.short()} at {key[0]} partitions", flush=True)
            times[key] = time_setting(torch, triton, prob, s, context)
        if not times:
            continue
        best = min(times, key=times.get)
        mine_key = (*mine.grid(context), mine.block_n, mine.num_warps)
        floor = kv_bytes(batch, context) / bw
        row = dict(batch=batch, context=context, copies=copies, ours=mine, best=runs_at[best], times=times,
                   ours_us=times.get(mine_key, float("nan")) * 1e6, best_us=times[best] * 1e6, floor_us=floor * 1e6)
        rows.append(row)
        print(f"batch {batch:3d} ctx {context:6d} ({copies} copies): ours {mine.short()} {row['ours_us']:8.1f} us "
              f"({floor / times.get(mine_key, float('nan')):5.1%} of copy) | best {runs_at[best].short()} "
              f"{row['best_us']:8.1f} us ({floor / times[best]:5.1%}) | {len(times)} runs", flush=True)
        del prob
        torch.cuda.empty_cache()
    for (s, n), why in wrong.items():
        print(f"WRONG {s.short()} at {n} partitions: {why}")
    if skipped:
        print(f"{skipped} runs skipped past the {args.budget:.0f} s budget")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r | dict(ours=asdict(r["ours"]), best=asdict(r["best"]),
                                              times={str(k): v for k, v in r["times"].items()}) for r in rows],
                                    indent=1))
    report(rows, [b for b in batches if any(r["batch"] == b for r in rows)], sms)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
