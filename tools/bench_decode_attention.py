"""Paged decode attention on a GPU, one Llama-3-8B layer (32 q heads, 8 KV heads, head dim 128, bf16, 16-token
blocks through shuffled block tables): its time at each (batch, context) under the split-K partitioning the CUDA
backend picks (Runner.decode_partition / max_partitions) and under a sweep of alternatives, as a share of the copy
bandwidth (the keys and values read once). Times are CUDA-graph replays (the launches' host cost left out, as the
backend's decode graphs do).

    python -m tools.bench_decode_attention [--batches 1,16,64] [--contexts 1024,4096,16384,32768] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
PARTITIONS = (64, 128, 256, 512)
MAX_PARTS = (4, 8, 16, 32, 64, 128)


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * 2


def problem(torch, batch: int, context: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = batch * (-(-context // BLOCK))
    kc = torch.randn((blocks + 1, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda", generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    q = torch.randn((batch, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda", generator=gen)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, kc, vc, tables, ctx


def time_config(torch, prob, partition: int, max_parts: int, context: int) -> float:
    """Seconds per call (decode + reduce), from CUDA-graph replays."""
    import triton.testing

    from kernels_src import paged_attention as pa

    q, kc, vc, tables, ctx = prob
    out = torch.empty_like(q)
    n_parts = min(pa.num_partitions(context, partition), max_parts)
    ws = pa.decode_workspace(q, n_parts) if n_parts > 1 else None

    def call():
        pa.paged_decode(q, kc, vc, tables, ctx, HEAD_DIM ** -0.5, out=out, max_context=context, partition=partition,
                        max_parts=max_parts, workspace=ws, target="triton")

    call()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(call, rep=20) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_decode_attention.json")
    args = ap.parse_args()
    import torch

    from backends.cuda.runner import decode_partition, max_partitions
    from tools.bench_gpu import copy_bandwidth

    bw = copy_bandwidth() * 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e9:,.0f} GB/s, {sms} SMs", flush=True)
    rows = []
    for batch, context in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
        prob = problem(torch, batch, context)
        ours = (decode_partition(batch, KV_HEADS), max_partitions(batch, KV_HEADS, sms))
        times = {}
        for part, mp in itertools.product(PARTITIONS, MAX_PARTS):
            if part * mp < context // 64 and mp < MAX_PARTS[-1]:
                continue  # partitions of thousands of keys: far too few programs
            times[(part, mp)] = time_config(torch, prob, part, mp, context)
        if ours not in times:
            times[ours] = time_config(torch, prob, *ours, context)
        best = min(times, key=times.get)
        floor = kv_bytes(batch, context) / bw
        row = dict(batch=batch, context=context, ours=ours, ours_us=times[ours] * 1e6, best=best,
                   best_us=times[best] * 1e6, floor_us=floor * 1e6)
        rows.append(row)
        print(f"batch {batch:3d} ctx {context:6d}: ours {ours} {row['ours_us']:8.1f} us ({floor / times[ours]:5.1%} of "
              f"copy) | best {best} {row['best_us']:8.1f} us ({floor / times[best]:5.1%})", flush=True)
        del prob
        torch.cuda.empty_cache()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1, default=str))
    print("\n| batch | context | ours (partition, max parts) | us | of copy | best | us | of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = r["floor_us"]
        print(f"| {r['batch']} | {r['context']} | {r['ours']} | {r['ours_us']:.1f} | {fl / r['ours_us']:.0%} "
              f"| {r['best']} | {r['best_us']:.1f} | {fl / r['best_us']:.0%} |")


if __name__ == "__main__":
    main()
