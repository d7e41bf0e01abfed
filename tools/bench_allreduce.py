"""All-reduce between GPUs, as tensor parallel runs it (backends.cuda.distributed: torch.distributed over NCCL, one
process a GPU), and each GPU's copy bandwidth: the two figures a tensor-parallel decode step is held against.

    python -m tools.bench_allreduce [--d 0,1] [--sizes decode,large | BYTES,..] [--dtype bf16] [--json FILE]
    python -m tools.bench_allreduce --cpu --world 2 --sizes 8192,65536 --dtype f32     (gloo on CPU tensors: a test)

Sizes: "decode" is what a decode step all-reduces after each row-parallel linear, 1 to 64 rows of a 4096 hidden (8
KiB to 512 KiB in bf16) and of 8192 (Llama-3-70B's); "large" 1 MiB to 1 GiB, where the links' bus bandwidth shows.
Each size is timed eager (the mean of many back-to-back all-reduces, the slowest rank's) and, on GPUs up to 1 MiB, as
the decode step runs it: inside a CUDA graph (a graph of 20 replayed). Bandwidth as nccl-tests defines it: algorithm
bandwidth = bytes / time; bus bandwidth = algorithm bandwidth * 2 (n - 1) / n, what each link carries, comparable
across world sizes. Every size is checked after timing: rank r contributes (r + 1) * (i % 7 + 1) at element i, and the
sum must be exact. NVLink SHARP multicast stays off (NCCL_NVLS_ENABLE=0, as the engine keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# Set before torch (and NCCL) load, in this process and the ranks it spawns: multicast objects are not lent.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
DECODE_HIDDEN = (4096, 8192)  # Llama-3-8B's and -70B's
LARGE = tuple(2**k for k in range(20, 31, 2))  # 1 MiB .. 1 GiB
GRAPH_MAX_BYTES = 2**20
GRAPH_REPS = 20  # all-reduces in one captured graph


def sizes_of(spec: str, itemsize: int) -> list[int]:
    """Element counts, ascending, from "decode", "large" and byte counts."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part == "decode":
            out |= {r * h for r in DECODE_ROWS for h in DECODE_HIDDEN}
        elif part == "large":
            out |= {b // itemsize for b in LARGE}
        else:
            out.add(max(1, int(part) // itemsize))
    return sorted(out)


def bus_factor(world: int) -> float:
    return 2 * (world - 1) / world


def pattern(n: int, rank: int, dtype, device) -> torch.Tensor:
    """Rank `rank`'s check input: (rank + 1) * (i % 7 + 1), small integers every dtype holds exactly (sums of up to 8
    ranks: at most 252)."""
    return ((torch.arange(n, device=device) % 7 + 1) * (rank + 1)).to(dtype)


def _elapsed(fn, reps: int, device) -> float:
    """Seconds a call of fn, the mean of `reps` back to back (after one untimed)."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def _graph_seconds(x: torch.Tensor, reps: int) -> float | None:
    """Seconds an all-reduce inside a CUDA graph takes (GRAPH_REPS of them captured, the graph replayed `reps`
    times), or None where capture fails."""
    from backends.cuda.distributed import all_reduce, dist

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # NCCL's own warm-up on the capturing stream
            all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_REPS):
                all_reduce(x)
        dist.barrier()
        return _elapsed(graph.replay, max(1, reps // GRAPH_REPS), x.device) / GRAPH_REPS
    except RuntimeError as e:
        print(f"  (graph capture of {x.numel()} elements failed: {e})", flush=True)
        return None


def rank_main(rank: int, world: int, port: int, devices: list[str], opts: dict) -> None:
    from backends.cuda import distributed
    from backends.cuda.distributed import Rendezvous, all_reduce, dist

    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    distributed.init(Rendezvous(rank, world, "127.0.0.1", port), device)
    dtype = DTYPES[opts["dtype"]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    copy = None
    if device.type == "cuda":  # every GPU at once: each its own memory
        from tools.bench_gpu_rates import copy_bandwidth

        copy = copy_bandwidth()
        torch.cuda.empty_cache()
    rows = []
    for n in sizes_of(opts["sizes"], itemsize):
        nbytes = n * itemsize
        reps = max(5, min(opts["max_reps"], int(4e9 // max(nbytes, 1))))
        x = torch.zeros(n, dtype=dtype, device=device)
        dist.barrier()
        t = _elapsed(lambda x=x: all_reduce(x), reps, device)
        tg = _graph_seconds(x, reps) if device.type == "cuda" and nbytes <= GRAPH_MAX_BYTES else None
        x = pattern(n, rank, dtype, device)
        all_reduce(x)
        ok = bool(torch.equal(x, pattern(n, world * (world + 1) // 2 - 1, dtype, device)))
        # the slowest rank's time, and whether every rank's sum was right
        stats = torch.tensor([t, -1.0 if tg is None else tg, 0.0 if ok else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        t, tg, bad = stats.tolist()
        rows.append({"elements": n, "bytes": nbytes, "us": t * 1e6, "alg_gbs": nbytes / t / 1e9,
                     "bus_gbs": nbytes / t / 1e9 * bus_factor(world), "graph_us": tg * 1e6 if tg > 0 else None,
                     "sum_ok": bad == 0, "total": float(x.double().sum())})  # rank 0's, for the test
    copies = [None] * world
    dist.all_gather_object(copies, copy)
    if rank == 0:
        report({"world": world, "devices": devices, "dtype": opts["dtype"], "copy_gbs": copies,
                "torch": torch.__version__, "backend": dist.get_backend(), "rows": rows,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}, Path(opts["json"]))
    distributed.shutdown()


def report(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    copies = ", ".join(f"{d} {c:,.0f} GB/s" for d, c in zip(res["devices"], res["copy_gbs"], strict=True) if c)
    print(f"\nall-reduce over {res['world']} x {res['gpu']} ({res['backend']}, {res['dtype']}, torch {res['torch']})"
          + (f"; copy bandwidth {copies}" if copies else ""))
    print(f"{'bytes':>12}{'elements':>12}{'us':>10}{'alg GB/s':>10}{'bus GB/s':>10}{'graph us':>10}  sum")
    for r in res["rows"]:
        graph = f"{r['graph_us']:.1f}" if r["graph_us"] else ""
        print(f"{r['bytes']:>12,}{r['elements']:>12,}{r['us']:>10.1f}{r['alg_gbs']:>10.2f}{r['bus_gbs']:>10.2f}"
              f"{graph:>10}  {'ok' if r['sum_ok'] else 'WRONG'}")
    print(f"(alg = bytes / time; bus = alg * 2(n-1)/n, nccl-tests' definitions; graph: inside a CUDA graph; {path})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", help="GPU ids, one rank each (default: every visible GPU)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU tensors (the test's), --world processes")
    ap.add_argument("--world", type=int, default=2, help="processes with --cpu")
    ap.add_argument("--sizes", default="decode,large", help="'decode', 'large' and byte counts (default %(default)s)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--max-reps", type=int, default=200, help="all-reduces timed a size, at most")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_allreduce.json")
    args = ap.parse_args()
    if args.cpu:
        devices = ["cpu"] * args.world
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_allreduce needs CUDA GPUs (or --cpu)")
        ids = args.d.split(",") if args.d else [str(i) for i in range(torch.cuda.device_count())]
        devices = [f"cuda:{i}" for i in ids]
    if len(devices) < 2:
        raise SystemExit(f"an all-reduce needs two ranks or more, not {len(devices)} ({devices})")
    from backends.tp_processes import free_port

    opts = {"dtype": args.dtype, "sizes": args.sizes, "max_reps": args.max_reps, "json": str(args.json)}
    mp.start_processes(rank_main, args=(len(devices), free_port(), devices, opts), nprocs=len(devices),
                       start_method="spawn")
    res = json.loads(args.json.read_text())
    if not all(r["sum_ok"] for r in res["rows"]):
        raise SystemExit("an all-reduce's sum was wrong (the WRONG rows above)")


if __name__ == "__main__":
    main()
