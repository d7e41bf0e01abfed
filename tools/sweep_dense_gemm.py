#!/usr/bin/env python3
"""Sweep kernels_src/dense_gemm's tiles against cuBLAS on a CUDA GPU: `python -m tools.sweep_dense_gemm [--ms
16,32,64] [--shapes 6144x4096,...] [--budget S] [--quick] [--margin 0.03] [--json FILE]`.

Every build (block_n x block_k x num_stages, swap, at each row bucket) is compiled first by worker processes and
checked against the float64 reference at each K of the sweep and every split (so the timing loop finds Triton's
disk cache holding the very specializations it launches); then per problem cuBLAS (torch.nn.functional.linear, as
the runner calls it) and a coordinate search from the launcher's own tiles (block_n, block_k, num_stages, split_k,
swap), CUDA-graph medians over enough weight copies that W is not found in L2, GB/s of W + x + y and % of copy.
Ends with the table, the TUNED literal of the settings that beat cuBLAS by --margin, and with --json the file
LLM_ENGINE_DENSE_GEMM_TUNED takes (rows marked `use`)."""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import numpy as np

from kernels_src import dense_gemm as dgm
from tools.sweep_gemm import parse_list, parse_shape, search

TARGET, DEVICE = "triton", "cuda"  # (a CPU test runs the sweep's code on the DSL interpreter)
MS = (16, 32, 64)
# (N, K): Llama-3-8B's qkv, o, gate+up, down, LM head
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
BLOCK_N = (32, 64, 128)
BLOCK_K = (64, 128, 256)
STAGES = (3, 4, 5)
SPLITS = (1, 2, 4, 8)
CHECK_N = 96  # the workers' check problem's N (odd tiles at block_n 64 and 128), at the sweep's K and rows
COLD_BYTES = 150 << 20  # weight bytes a timed call walks through (3x the H200's 50 MB L2)
TOL = 2e-2  # of the largest output: bf16 y
MARGIN = 0.03  # how much faster than cuBLAS a setting must be to enter the table
SMEM_BYTES = 232448  # an sm_90 block's shared memory: builds whose pipeline needs more are not compiled


def builds(m: int, quick: bool) -> list[dict]:
    """The keywords that change a build at m rows (split_k only as 1 against more: the check runs each split); those
    whose num_stages bf16 tiles of W and x do not fit SMEM_BYTES are left out."""
    block_m = min(dgm.MAX_BLOCK_M, dgm.row_bucket(m))
    out = [dict(block_m=block_m, block_n=bn, block_k=bk, num_stages=ns, num_warps=8 if bn == 128 else 4, swap=True)
           for bn, bk, ns in itertools.product(BLOCK_N, BLOCK_K, (4,) if quick else STAGES)
           if 2 * (bn + block_m) * bk * ns <= SMEM_BYTES]
    return out + [dict(block_m=block_m, block_n=64, block_k=128, num_stages=4, num_warps=4, swap=False)]


def _build_key(cfg: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in cfg.items() if k != "split_k"))


def rule(m: int, n: int, k: int) -> dict:
    """The launcher's own tiles for the problem, as its keywords."""
    inverse = {v: key for key, v in dgm._KEYS.items()}
    return {inverse[key]: v for key, v in dgm.default_tiles(m, n, k).items()}


def _randn(torch, shape, seed: int, scale: float = 1.0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return (torch.randn(shape, device=DEVICE, generator=g) * scale).bfloat16()


def check(job) -> tuple:
    """Worker: one build on [m, K] x [CHECK_N, K] at each K and split against the reference; (job, max relative
    error, or the compiler's refusal)."""
    m, ks, cfg = job
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    err = 0.0
    for k, split in itertools.product(ks, SPLITS):
        if -(-k // cfg["block_k"]) < split:
            continue
        x, w = _randn(torch, (m, k), m), _randn(torch, (CHECK_N, k), k, k ** -0.5)
        y = torch.full((m, CHECK_N), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        try:
            dgm.dense_matmul(x, w, out=y, target=TARGET, split_k=split, **cfg)
        except Exception as e:  # a build the compiler refuses (shared memory, registers) is out of the sweep
            return job, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        want = dgm.dense_matmul_ref(x.float().cpu().numpy(), w.float().cpu().numpy())
        got = y.float().cpu().numpy().astype(np.float64)
        err = max(err, float(np.abs(got - want).max() / np.abs(want).max()) if np.isfinite(got).all() else np.inf)
    return job, err


def _time(torch, fn) -> float:
    """us of fn: the median of CUDA-graph replays."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median")


BENCH = _time  # us of a call (a CPU test puts a fake clock here)


@dataclass
class Result:
    m: int
    n: int
    k: int
    cublas_us: float
    us: float  # the best setting's (nan: none passed, or out of time)
    own_us: float  # the launcher's own tiles'
    tiles: dict
    nbytes: int  # W, x and y once

    def gbps(self, us: float) -> float:
        return self.nbytes / us / 1e3

    def use(self, margin: float) -> bool:
        return self.us == self.us and self.us <= self.cublas_us * (1 - margin)


def time_problems(problems, bad: set, bench, budget: float, t0: float, quick: bool, done=lambda results: None):
    """cuBLAS and the coordinate search on each (m, n, k) until the budget is spent (those left: us = nan);
    `done(results so far)` after each problem (the JSON is written as it goes: a call cut short keeps its rows)."""
    nan, out = float("nan"), []
    for m, n, k in problems:
        out.append(_time_one(m, n, k, bad, bench, quick) if time.perf_counter() - t0 <= budget
                   else Result(m, n, k, nan, nan, nan, {}, 2 * (n * k + m * k + m * n)))
        r = out[-1]
        print(f"  M={m} {n}x{k}: cuBLAS {r.cublas_us:.1f} us, ours {r.us:.1f} us {r.tiles or ''}", flush=True)
        done(out)
    return out


def _time_one(m: int, n: int, k: int, bad: set, bench, quick: bool) -> Result:
    """One problem: each timed call runs through enough weight copies (COLD_BYTES) that W is not found in L2."""
    import torch
    import torch.nn.functional as F

    copies = max(1, -(-COLD_BYTES // (2 * n * k)))
    ws = [_randn(torch, (n, k), n + k + i, k ** -0.5) for i in range(copies)]
    x = _randn(torch, (m, k), m)
    y = torch.empty((m, n), device=DEVICE, dtype=torch.bfloat16)
    cublas = bench(lambda: [F.linear(x, w) for w in ws]) / copies
    allowed = {_build_key(b) for b in builds(m, quick)}

    def ok(c):
        return _build_key(c) in allowed and (m, _build_key(c)) not in bad and -(-k // c["block_k"]) >= c["split_k"]

    def run(c):
        for w in ws:
            dgm.dense_matmul(x, w, out=y, target=TARGET, **c)

    axes = dict(block_n=BLOCK_N, block_k=BLOCK_K, num_stages=(4,) if quick else STAGES, split_k=SPLITS,
                swap=(True, False))
    best, us, own, _ = search(bench, run, rule(m, n, k), ok, axes)
    return Result(m, n, k, cublas, us / copies, own / copies, best, 2 * (n * k + m * k + m * n))


def report(results: list[Result], gbps: float, margin: float) -> None:
    """Prints the table and the TUNED literal of the settings that beat cuBLAS by `margin`."""
    print(f"\ncopy {gbps:.0f} GB/s (read + write); bf16, CUDA-graph medians; GB/s of W + x + y")
    print(f"{'M':>4} {'N x K':>12} {'cuBLAS us':>9} {'GB/s':>6} {'ours us':>8} {'GB/s':>6} {'%copy':>6} {'own us':>7} "
          f"{'speedup':>7}  best tiles")
    for r in results:
        if r.cublas_us != r.cublas_us:
            print(f"{r.m:4} {f'{r.n}x{r.k}':>12}  skipped: out of time")
            continue
        tiles = str(r.tiles) if r.tiles else "no setting passed the check"
        print(f"{r.m:4} {f'{r.n}x{r.k}':>12} {r.cublas_us:9.1f} {r.gbps(r.cublas_us):6.0f} {r.us:8.1f} "
              f"{r.gbps(r.us):6.0f} {100 * r.gbps(r.us) / gbps:6.1f} {r.own_us:7.1f} {r.cublas_us / r.us:6.3f}x  "
              f"{tiles}" + ("  <- table" if r.use(margin) else ""))
    print(f"\n# paste into kernels_src/dense_gemm.py (row bucket, n, k): the settings {100 * margin:g}% or more faster "
          "than cuBLAS\nTUNED = {")
    seen = set()
    for r in sorted((r for r in results if r.use(margin)), key=lambda r: (r.m, r.n, r.k)):
        key = (dgm.row_bucket(r.m), r.n, r.k)
        lead = "#  (a smaller M's entry holds this bucket) " if key in seen else "    "
        seen.add(key)
        print(f"{lead}{key!r}: {r.tiles!r},")
    print("}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x (9 or more)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K of W")
    ap.add_argument("--quick", action="store_true", help="num_stages 4 builds only")
    ap.add_argument("--margin", type=float, default=MARGIN, help="fraction faster than cuBLAS a table entry must be")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                    help="build processes (0: build and check in this one)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds in all; problems past it are skipped")
    ap.add_argument("--json", help="write the results here (LLM_ENGINE_DENSE_GEMM_TUNED=FILE takes it)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ms = parse_list(args.ms, "--ms")
    try:
        shapes = [parse_shape(t) for t in args.shapes.split(",") if t.strip()]
    except ValueError as e:
        raise SystemExit(f"sweep_dense_gemm: bad --shapes: {e}") from None
    if not ms or min(ms) < dgm.MIN_ROWS or not shapes:
        raise SystemExit(f"sweep_dense_gemm: --ms are rows of {dgm.MIN_ROWS} or more (fewer take dense_gemv or "
                         f"cuBLAS), and --shapes at least one NxK; got {ms} and {shapes}")
    ks = tuple(sorted({k for _, k in shapes}))
    jobs = sorted({(m, _build_key(b)) for m in ms for b in builds(m, args.quick)})
    work = [(m, ks, dict(b)) for m, b in jobs]
    if args.workers:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            checks = {(j[0], _build_key(j[2])): e for j, e in pool.imap_unordered(check, work)}
    else:  # in this process (a CPU test: the module's TARGET and DEVICE as set)
        checks = {(j[0], _build_key(j[2])): e for j, e in map(check, work)}
    bad = {job for job, e in checks.items() if not (isinstance(e, float) and e <= TOL)}
    worst = max((e for e in checks.values() if isinstance(e, float)), default=0.0)
    print(f"built and checked {len(jobs)} builds in {time.perf_counter() - t0:.0f} s; worst error {worst:.2e} of the "
          f"largest output (limit {TOL:g}); failed: {[(m, dict(b), checks[(m, b)]) for m, b in bad] or 'none'}",
          flush=True)
    import torch

    from tools.bench_kernels import copy_gbps

    gbps = copy_gbps(torch, 2**30)
    def write(results):
        if not args.json:
            return
        rows = [dict(m=r.m, n=r.n, k=r.k, us=r.us, cublas_us=r.cublas_us, own_us=r.own_us, gbps=r.gbps(r.us),
                     cublas_gbps=r.gbps(r.cublas_us), tiles=r.tiles, use=r.use(args.margin)) for r in results]
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbps=gbps, margin=args.margin, failed=[str(j) for j in bad], results=rows), f,
                      indent=1)

    results = time_problems([(m, n, k) for m in ms for n, k in shapes], bad, lambda fn: BENCH(torch, fn), args.budget,
                            t0, args.quick, write)
    report(results, gbps, args.margin)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
