#!/usr/bin/env python3
"""Sweep dequant_matmul's launcher keywords on a CUDA GPU: `python -m tools.sweep_gemm [--quick] [--budget S]`.

For Q4_K, Q6_K, Q5_K, Q8_0 at M = 16, 32, 64 on 14336x4096, 4096x14336 and 6144x4096 (N x K), bf16 x: every
compile variant (block_n x num_stages, swap, num_warps) is built first by worker processes (Triton's disk cache
is shared, so the timing loop only loads them) and checked once against the float64 reference on sampled columns;
then a coordinate search per problem (block_n, num_stages, split_k, swap, from default_tiles) timed
with triton.testing.do_bench_cudagraph, and dequant_gemv at M = 8 (and two M = 8 launches for 16) for the
crossover. Ends with one table and `TUNED = {...}` for kernels_src/dequant_gemm.py."""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import numpy as np

QTYPES = ("Q4_K", "Q6_K", "Q5_K", "Q8_0")
MS = (16, 32, 64)
SHAPES = ((14336, 4096), (4096, 14336), (6144, 4096))  # (N, K): gate/up, down, qkv of Llama-3-8B
BLOCK_N = (32, 64, 128)
STAGES = (2, 3, 4)
SPLITS = (1, 2, 4, 8)
TOL = 2e-2  # of the largest output: bf16 x, W and y rounded to bf16


def _bucket(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def variants(qtype: str, quick: bool) -> list[dict]:
    """Compile variants (the keywords that change the kernel's build; split_k does not)."""
    stages = (3,) if quick or qtype in ("Q5_K", "Q8_0") else STAGES
    out = [dict(block_n=bn, num_stages=ns, num_warps=8 if bn == 128 else 4, swap=True)
           for bn, ns in itertools.product(BLOCK_N, stages)]
    return out + [dict(block_n=64, num_stages=3, num_warps=4, swap=False)]


def _setup(seed: int = 0):
    import torch

    from tools.kernel_cases import gguf_weights

    dev = SimpleNamespace(torch=torch, dev="cuda", gen=torch.Generator("cuda").manual_seed(seed))
    return torch, lambda q, n, k: gguf_weights(dev, q, n, k)


_PROBLEMS: dict = {}


def _problem(torch, weights, qtype, m, n, k):
    key = (qtype, m, n, k)
    if key not in _PROBLEMS:
        g = torch.Generator("cuda").manual_seed(sum(map(ord, qtype)) * 7919 + m * 31 + n + k)
        _PROBLEMS[key] = (weights(qtype, n, k), torch.randn((m, k), device="cuda", generator=g).bfloat16())
    return _PROBLEMS[key]


def _warm(job):
    """Worker: build one compile variant at every problem of its row bucket (fills Triton's cache); check it."""
    qtype, m, var = job
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch, weights = _setup()
    from kernels_src.dequant_gemm import dequant_matmul, dequant_matmul_ref

    err = 0.0
    for n, k in SHAPES:
        w, x = _problem(torch, weights, qtype, m, n, k)
        y = dequant_matmul(x, w, qtype, target="triton", **var)
        if (n, k) == SHAPES[-1]:
            cols = torch.randperm(n, device="cuda")[:48].cpu().numpy()
            want = dequant_matmul_ref(x.float().cpu().numpy(), w[cols].cpu().numpy(), qtype)
            got = y[:, cols].float().cpu().numpy().astype(np.float64)
            err = float(np.abs(got - want).max() / np.abs(want).max()) if np.isfinite(got).all() else np.inf
    return job, err


def _time(torch, fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median")


def _search(torch, run, default: dict, allowed: list[dict], steps: int, bad: set) -> tuple[dict, float, float]:
    """Coordinate search from the default: each keyword in turn over its values, keeping the best (num_warps
    follows block_n: 8 for 128)."""
    seen: dict = {}

    def t(cfg):
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen[key] = _time(torch, lambda: run(cfg))
        return seen[key]

    def ok(cfg):
        build = {k: cfg[k] for k in ("block_n", "num_stages", "num_warps", "swap")}
        return build in allowed and tuple(sorted(build.items())) not in bad and steps // cfg["split_k"] >= 2

    best = dict(default)
    base = t(best)
    axes = dict(block_n=BLOCK_N, num_stages=STAGES, split_k=SPLITS, swap=(True, False))
    for key, values in axes.items():
        for v in values:
            cand = dict(best, **{key: v})
            if key == "block_n":
                cand["num_warps"] = 8 if v == 128 else 4
            if ok(cand) and t(cand) < t(best):
                best = cand
    return best, t(best), base


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="num_stages 3 only, Q4_K and Q6_K only")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--budget", type=float, default=70.0, help="seconds; problems left when it runs out are skipped")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    qtypes = QTYPES[:2] if args.quick else QTYPES
    jobs = [(q, m, v) for q in qtypes for m in MS for v in variants(q, args.quick)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        checks = dict(((q, m, tuple(sorted(v.items()))), e) for (q, m, v), e in pool.imap_unordered(_warm, jobs))
    bad = {key for key, e in checks.items() if not e <= TOL}
    print(f"built and checked {len(jobs)} variants in {time.perf_counter() - t0:.0f} s; worst error "
          f"{max(checks.values()):.2e} of the largest output (limit {TOL:g}); failed: {sorted(bad) or 'none'}")
    torch, weights = _setup()
    from kernels_src.dequant_gemm import _KEYS, GGUF, default_tiles, dequant_matmul
    from kernels_src.dequant_gemv import dequant_gemv
    from tools.bench_kernels import copy_gbps

    inverse = {v: k for k, v in _KEYS.items()}
    copy = copy_gbps(torch, 2**30)
    rows, tuned = [], {}
    for q, m, (n, k) in itertools.product(qtypes, MS, SHAPES):
        if time.perf_counter() - t0 > args.budget:
            rows.append((q, m, n, k, "skipped: out of time", 0, 0, 0))
            continue
        w, x = _problem(torch, weights, q, m, n, k)
        y = torch.empty((m, n), dtype=x.dtype, device="cuda")
        d = {inverse[key]: v for key, v in default_tiles(q, m, n, k).items() if key != "KB"}
        d["num_stages"] = d["num_stages"] or 3
        allowed = variants(q, args.quick)
        bad_m = {key[2] for key in bad if key[:2] == (q, m)}
        steps = k // GGUF[q].block_size // default_tiles(q, m, n, k)["KB"]
        def run(c, x=x, w=w, q=q, y=y):
            return dequant_matmul(x, w, q, out=y, target="triton", **c)

        best, us, base = _search(torch, run, d, allowed, steps, bad_m)
        gb = (w.numel() + x.numel() * 2 + y.numel() * 2) / 1e3
        rows.append((q, m, n, k, best, us, base, 100 * gb / us / copy))
        tuned[(q, m, n, k)] = best
    gemv = []
    for q, (n, k) in itertools.product(qtypes, SHAPES):
        w, x = _problem(torch, weights, q, 16, n, k)
        y8 = torch.empty((8, n), dtype=x.dtype, device="cuda")
        def gemv8(rows, x=x, w=w, q=q, y8=y8):
            return [dequant_gemv(x[r:r + 8], w, q, out=y8, target="triton") for r in rows]

        one, two = _time(torch, lambda: gemv8((0,))), _time(torch, lambda: gemv8((0, 8)))
        gemv.append((q, n, k, one, two))
    print(f"\ncopy {copy:.0f} GB/s (read + write); dequant_matmul, bf16 x, CUDA-graph median")
    print(f"{'type':5} {'M':>3} {'N x K':>11} {'us':>7} {'default':>8} {'%copy':>6}  best config")
    for q, m, n, k, best, us, base, pct in rows:
        print(f"{q:5} {m:3} {f'{n}x{k}':>11} {us:7.1f} {base:8.1f} {pct:6.1f}  {best}")
    print(f"\n{'type':5} {'N x K':>11} {'gemv M=8 us':>12} {'2x M=8 (M=16) us':>17}")
    for q, n, k, one, two in gemv:
        print(f"{q:5} {f'{n}x{k}':>11} {one:12.1f} {two:17.1f}")
    print("\n# paste into kernels_src/dequant_gemm.py (keys: qtype, row bucket, n, k)")
    print("TUNED = {")
    for (q, m, n, k), cfg in tuned.items():
        print(f"    ({q!r}, {_bucket(m)}, {n}, {k}): {cfg!r},")
    print("}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
