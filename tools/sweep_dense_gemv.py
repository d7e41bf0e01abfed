"""Time dense_gemv over tile settings against cuBLAS (torch.nn.functional.linear) on a CUDA GPU, alone and with its
prologue fused, and print the best tiles per shape and M as a pasteable TILES table.

    python -m tools.sweep_dense_gemv [--quick] [--budget 60] [--models llama,phi3] [--batches 1,4,8] [--lm-head]

Llama-3-8B's projections (N x K: qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) and
phi-3-mini's (9216 x 3072, 3072 x 3072, 16384 x 3072, 3072 x 8192), bf16, at M = 1, 4, 8; each with the op the runner
fuses into it (qkv, gate_up: the residual add + RMS norm; down: the gated activation; o: none). Per shape and M:
- cublas: F.linear on the projection's input; ours: dense_gemv at each setting (the best shown, and the default's);
- unfused: the DSL's add_rms_norm / gated_act kernel, then F.linear: what the runner runs with dense_gemv off;
- unfused ours: that kernel, then dense_gemv at its best setting: the switch on without prologues;
- fused: dense_gemv with the prologue, at the default setting and the three best plain ones.
CUDA-graph replays (triton.testing.do_bench_cudagraph) cycle over enough weight copies that none is found in L2.
Every setting is compiled and checked against dense_gemv_ref first, in worker processes (they fill Triton's on-disk
cache), so the timing pass only replays. Timings run essentials first (cuBLAS, the default tiles, unfused, fused at
the default) for every shape, then the other settings until --budget seconds have passed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

MODELS = {  # name, N, K, the prologue the runner fuses into the projection
    "llama": [("qkv", 6144, 4096, "add_rms_norm"), ("o", 4096, 4096, "none"), ("gate_up", 28672, 4096, "add_rms_norm"),
              ("down", 4096, 14336, "gated")],
    "phi3": [("qkv", 9216, 3072, "add_rms_norm"), ("o", 3072, 3072, "none"), ("gate_up", 16384, 3072, "add_rms_norm"),
             ("down", 3072, 8192, "gated")],
}
LM_HEAD = {"llama": ("lm_head", 128256, 4096, "none"), "phi3": ("lm_head", 32064, 3072, "none")}
ROWS = {1: (1, 2, 4), 4: (1, 2, 4), 8: (2, 4, 8)}
STEPS = ((256, 1), (512, 1), (512, 2), (1024, 4), (2048, 4), (2048, 8))  # (BLOCK_K, warps): 1-2 vectors a lane, row
TARGET, DEVICE = "triton", "cuda"  # (a CPU test runs the sweep's code on the DSL interpreter)


def settings(m: int, quick: bool = False) -> list[dict]:
    """The default rule's tiles first, then rows a program x (BLOCK_K, warps)."""
    from kernels_src.dense_gemv import default_tiles

    out = [default_tiles(0, 0, m)]  # (0, 0): no table entry, the rule
    for rows, (bk, nw) in itertools.product(ROWS[m], STEPS):
        s = dict(ROWS=rows, BLOCK_K=bk, num_warps=nw)
        if s not in out and not quick:
            out.append(s)
    return out


def _kw(s: dict) -> dict:
    return dict(rows=s["ROWS"], block_k=s["BLOCK_K"], num_warps=s["num_warps"])


def _t(s: dict) -> tuple:
    """A setting as a key: (ROWS, BLOCK_K, num_warps)."""
    return s["ROWS"], s["BLOCK_K"], s["num_warps"]


def _s(t: tuple) -> dict:
    return dict(zip(("ROWS", "BLOCK_K", "num_warps"), t, strict=True))


def _check(job) -> str | None:
    """Compile (into Triton's cache) and check one setting on a 48-row case of the shape's K: None, or the problem."""
    try:
        return _check_one(*job)
    except Exception as e:  # noqa: BLE001 - a setting that fails to build or run is reported, the rest go on
        return f"{type(e).__name__}: {str(e)[:300]}"


def _check_one(m: int, s: dict, prologue: str, k: int) -> str | None:
    import numpy as np
    import torch

    from kernels_src.dense_gemv import dense_gemv, dense_gemv_ref
    from tools.kernel_case_base import Dev, host
    from tools.kernel_cases_dense import _host_prologue, dense_inputs

    x, w, pro, _ = dense_inputs(Dev(1, DEVICE), m, 48, k, prologue, torch.bfloat16)
    got = dense_gemv(x, w, prologue=pro, target=TARGET, **_kw(s))
    want = dense_gemv_ref(host(x), host(w), _host_prologue(pro))
    got, want = (host(got[1]), want[1]) if prologue == "add_rms_norm" else (host(got), want)
    bad = ~(np.abs(got - want) <= 1e-2 * np.abs(want) + 2e-3 * np.abs(want).max())
    return f"{bad.sum()} of {bad.size} outputs off (max |dy| {np.nanmax(np.abs(got - want)):.3g})" if bad.any() \
        else None


def _jobs(shapes, batches, quick: bool) -> list[tuple]:
    """One job per binary: (M, setting, prologue, K), K's only effect being whether BLOCK_K divides it (EVEN_K)."""
    seen, jobs = set(), []
    for (_, _, k, pro), m in itertools.product(shapes, batches):
        for s in settings(m, quick):
            for p in {"none", pro}:
                key = _key(m, s, p, k)
                if key not in seen:
                    seen.add(key)
                    jobs.append((m, s, p, k))
    return jobs


def _key(m, s, p, k) -> tuple:
    return (m, _t(s), p, k % s["BLOCK_K"] == 0)


class Case:
    """One projection at one M: its weight copies and inputs, the calls the sweep times on them, and the times."""

    def __init__(self, torch, d, ws, name: str, m: int, prologue: str):
        from kernels_src import activations, rms_norm
        from kernels_src.dense_gemv import AddRMSNorm
        from tools.kernel_cases_dense import dense_inputs

        self.name, self.m, self.prologue, (self.n, self.k) = name, m, prologue, tuple(ws[0].shape)
        self.torch, self.ws = torch, itertools.cycle(ws)
        self.x, _, self.pro, _ = dense_inputs(d, m, 1, self.k, prologue, torch.bfloat16)
        if prologue == "add_rms_norm":
            sum_out = torch.empty_like(self.x)
            pro = self.pro
            self.small = lambda: rms_norm.add_rms_norm(self.x, pro.residual, pro.w, pro.eps, sum_out=sum_out,
                                                       target=TARGET)[1]
            self.pro = AddRMSNorm(pro.residual, pro.w, pro.eps, sum_out=sum_out)
        elif prologue == "gated":
            self.small = lambda: activations.gated_act_fused(self.x, self.pro.act, target=TARGET)
        else:
            self.small = lambda: self.x
        self.xp = self.small()  # the projection's input, as the unfused kernel writes it
        self.us: dict = {"ours": {}, "fused": {}}  # what -> us; ours and fused: {_t(setting): us}

    def cublas(self):
        return self.torch.nn.functional.linear(self.xp, next(self.ws))

    def unfused(self):
        return self.torch.nn.functional.linear(self.small(), next(self.ws))

    def ours(self, s: dict, fused: bool = False, small: bool = False):
        from kernels_src.dense_gemv import dense_gemv

        def call():
            x = self.x if fused else self.small() if small else self.xp
            return dense_gemv(x, next(self.ws), prologue=self.pro if fused else None, target=TARGET, **_kw(s))
        return call

    def best(self, what: str) -> tuple | None:
        return min(self.us[what], key=self.us[what].get, default=None)


def _compile_all(shapes, batches, quick: bool) -> dict:
    """_key -> None or what was wrong, from worker processes."""
    jobs = _jobs(shapes, batches, quick)
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return {_key(*j): p for j, p in zip(jobs, pool.map(_check, jobs), strict=True)}


def _time(cases, problems: dict, bench, budget: float, t0: float, quick: bool) -> int:
    """Essentials for every case first, then the other settings until the budget: the number left untimed."""
    ok = lambda c, s, p: not problems.get(_key(c.m, s, p, c.k))
    for c in cases:
        s0 = settings(c.m)[0]
        c.us["cublas"], c.us["unfused"] = bench(c.cublas), bench(c.unfused)
        if ok(c, s0, "none"):
            c.us["ours"][_t(s0)] = bench(c.ours(s0))
        if c.prologue != "none" and ok(c, s0, c.prologue):
            c.us["fused"][_t(s0)] = bench(c.ours(s0, fused=True))
    print(f"essentials timed at {time.perf_counter() - t0:.0f} s", flush=True)
    skipped = 0
    for c in cases:
        for s in settings(c.m, quick)[1:]:
            if time.perf_counter() - t0 > budget:
                skipped += 1
            elif ok(c, s, "none"):
                c.us["ours"][_t(s)] = bench(c.ours(s))
        if c.prologue == "none":
            continue
        top = sorted(c.us["ours"], key=c.us["ours"].get)[:3]
        for t in top:
            if t not in c.us["fused"] and ok(c, _s(t), c.prologue) and time.perf_counter() - t0 <= budget:
                c.us["fused"][t] = bench(c.ours(_s(t), fused=True))
        if top:
            c.us["unfused_ours"] = bench(c.ours(_s(top[0]), small=True))
    return skipped


def _report(cases, gbps: float) -> dict:
    """Print a row per case; the best settings by (N, K, M, prologue)."""
    from kernels_src.registry_linear import dense_gemv_bytes

    nan = float("nan")
    pct = lambda us, c: 100 * dense_gemv_bytes(c.m, c.n, c.k, "none", "bfloat16") / us / 1e3 / gbps
    print(f"\n{'shape':15} {'N x K':>12} {'M':>1} {'cublas us':>9} {'%copy':>5} {'ours us':>7} {'%copy':>5} "
          f"{'cublas/ours':>11} {'default':>7} | {'prologue':12} {'unfused':>7} {'+ours':>7} {'fused':>7} "
          f"{'gain':>5}  best / best fused (ROWS, BLOCK_K, warps)")
    table = {}
    for c in cases:
        best, bf = c.best("ours"), c.best("fused")
        ours, fused = c.us["ours"].get(best, nan), c.us["fused"].get(bf, nan)
        default = c.us["ours"].get(_t(settings(c.m)[0]), nan)
        unfused = c.us["unfused"] if c.prologue != "none" else nan
        print(f"{c.name:15} {f'{c.n}x{c.k}':>12} {c.m:>1} {c.us['cublas']:9.2f} {pct(c.us['cublas'], c):5.1f} "
              f"{ours:7.2f} {pct(ours, c):5.1f} {c.us['cublas'] / ours:11.2f} {default:7.2f} | {c.prologue:12} "
              f"{unfused:7.2f} {c.us.get('unfused_ours', nan):7.2f} {fused:7.2f} {unfused / fused:5.2f}  {best} / {bf}")
        if best:
            table[(c.n, c.k, c.m, "none")] = _s(best)
        if bf:
            table[(c.n, c.k, c.m, c.prologue)] = _s(bf)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="default tiles only")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds; settings past the defaults stop there")
    ap.add_argument("--models", default="llama,phi3", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--batches", default="1,4,8", help="rows M (1-8; the table's buckets are 1, 4, 8)")
    ap.add_argument("--lm-head", action="store_true", help="also each model's LM head (no prologue)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch
    import triton
    import triton.testing

    from tools.bench_kernels import copy_gbps
    from tools.kernel_case_base import Dev

    models = [s.strip() for s in args.models.split(",") if s.strip()]
    shapes = [(f"{mod}.{name}", n, k, p) for mod in models
              for name, n, k, p in MODELS[mod] + ([LM_HEAD[mod]] if args.lm_head else [])]
    batches = [int(b) for b in args.batches.split(",")]
    problems = _compile_all(shapes, batches, args.quick)
    print(f"compiled and checked {len(problems)} settings in {time.perf_counter() - t0:.0f} s", flush=True)
    gbps = copy_gbps(torch, 2**30)
    print(f"copy {gbps:.0f} GB/s; {torch.cuda.get_device_name()}", flush=True)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    d = Dev(2, DEVICE)
    cases = []
    for name, n, k, p in shapes:
        ws = [d.randn((n, k), torch.bfloat16, k ** -0.5) for _ in range(max(2, -(-3 * l2 // (2 * n * k))))]
        cases += [Case(torch, d, ws, name, m, p) for m in batches]
    bench = lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=3, return_mode="median")
    skipped = _time(cases, problems, bench, args.budget, t0, args.quick)
    table = _report(cases, gbps)
    for key, why in problems.items():
        if why:
            print(f"WRONG {key}: {why}")
    if skipped:
        print(f"({skipped} settings past --budget {args.budget:.0f} s not timed)")
    print("\n# gain: unfused (kernel + cuBLAS) over fused; +ours: the kernel + dense_gemv; %copy: W, x and y over the "
          "copy rate")
    print(f"# the best settings by (N, K, M, prologue) ({time.perf_counter() - t0:.0f} s), for dense_gemv.TILES:")
    print("TILES = {")
    for key, s in table.items():
        print(f"    {key!r}: {s},")
    print("}")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
