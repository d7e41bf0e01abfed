#!/usr/bin/env python3
"""Sweep the quantized tensor-core GEMMs' variants and tiles on a CUDA GPU: `python -m tools.sweep_gemm [--variants
blocked,words,sub64,gather,stream,mmq] [--ms 16,64,128] [--shapes 14336x4096,...] [--qtypes Q4_K,Q6_K,int4g128]
[--budget S] [--json FILE]`.

GGUF types go through dequant_matmul (kernels_src/dequant_gemm.py), intBgG (GPTQ/AWQ layout, B bits, groups of G)
through int_group_matmul; a variant runs where it takes the type. Every build (variant x block_n x num_stages, swap,
at each row bucket) is compiled first by worker processes (Triton's disk cache is shared, so the timing loop only
loads them), each checked at split 1 and 2 against the float64 reference on a small problem; then per problem and
variant a coordinate search from the launcher's own tiles (block_n, num_stages, split_k, swap; stream's chunks; the
int-group mmq's block_m and num_warps, at its block_n 64 / 128, swap only),
CUDA-graph medians, "% of copy" against tools.bench_kernels.copy_gbps. Ends with a table, the best of each problem,
and the literals for dequant_gemm.TUNED and int_group_gemm.TUNED (their `variant` named)."""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from kernels_src import dequant_gemm as dgm
from kernels_src import int_group_gemm as igm
from kernels_src.int_group_gemm_stream import accs_for

TARGET, DEVICE = "triton", "cuda"  # (a CPU test runs the sweep's code on the DSL interpreter)
MS = (16, 64, 128)
SHAPES = ((14336, 4096), (4096, 14336), (6144, 4096), (28672, 4096))  # (N, K): Llama-3-8B's up, down, qkv, gate+up
QTYPES = ("Q4_K", "Q6_K", "int4g128")
BLOCK_N = (32, 64, 128)
STAGES = (2, 3, 4)
SPLITS = (1, 2, 4, 8)
CHUNKS = (1, 2, 4)  # variant stream's step: 64-input chunks of a super-block
MMQ_BLOCK_M = (16, 32, 64, 128)  # the int-group mmq's row tiles, up to the problem's row bucket
MMQ_BLOCK_N = (64, 128)  # its W tiles (a warpgroup's 64 rows of the MMA at least)
CHECK_N, CHECK_K = 96, 1024  # the workers' check problem (odd N tiles at block_n 64 and 128)
COLD_BYTES = 150 << 20  # weight bytes a timed call walks through (3x the H200's 50 MB L2)
TOL = 2e-2  # of the largest output: bf16 x, W rounded to bf16 for the dot, y in bf16


@dataclass(frozen=True)
class Kind:
    """A weight type: a GGUF qtype, or integer groups (bits, group) named intBgG."""
    name: str
    bits: int = 0
    group: int = 0

    @property
    def variants(self) -> tuple[str, ...]:
        if self.bits:  # mmq where its step fits the groups (rows of whole steps: checked in main)
            return tuple(v for v in igm.VARIANTS if v != "mmq" or igm.mmq_fits(self.bits, self.group, 128 * self.group))
        return tuple(v for v, qs in dgm.VARIANTS.items() if qs is None or self.name in qs)


def parse_kind(text: str) -> Kind:
    m = re.fullmatch(r"int([48])g(\d+)", text.strip().lower())
    if m:
        return Kind(text.strip().lower(), int(m.group(1)), int(m.group(2)))
    q = text.strip().upper()
    if q not in dgm.dq.QTYPES:
        raise SystemExit(f"sweep_gemm: unknown type {text!r} (GGUF: {', '.join(dgm.dq.QTYPES)}; or intBgG, B 4 or 8)")
    return Kind(q)


def parse_list(text: str, what: str, conv=int) -> list:
    try:
        return [conv(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise SystemExit(f"sweep_gemm: bad {what} {text!r}: {e}") from None


def parse_shape(text: str) -> tuple[int, int]:
    n, sep, k = text.strip().partition("x")
    if not (sep and n.isdigit() and k.isdigit()):
        raise ValueError(f"want NxK, got {text!r}")
    return int(n), int(k)


def bucket(kind: Kind, m: int) -> int:
    return igm.rows_bucket(m) if kind.bits else dgm.row_block(m)


def rule(kind: Kind, variant: str, m: int, n: int, k: int) -> dict:
    """The launcher's own tiles for the problem, as its keywords (num_stages None -> 3)."""
    if kind.bits:
        cfg, keys = igm.default_tiles(m, n, k, kind.bits, kind.group, variant=variant), igm._KEYS
    else:
        cfg, keys = dgm.default_tiles(kind.name, m, n, k), dgm._KEYS
    inverse = {v: key for key, v in keys.items()}
    out = {inverse[key]: v for key, v in cfg.items() if key in ("BLOCK_M", "BLOCK_N", "SPLIT", "SWAP", "num_warps",
                                                                 "num_stages")}
    out["num_stages"] = out["num_stages"] or 3
    if "accs" in axes(kind, variant, m):  # the launcher's own choice of stream's accumulators at these tiles
        out["accs"] = accs_for(kind.bits, out["block_m"], out["block_n"], out["num_warps"], out["swap"])
    if "chunks" in axes(kind, variant, m):  # the GGUF stream's step, quarters of a super-block
        out["chunks"] = cfg.get("CHUNKS") or dgm.STREAM_CHUNKS
    return out


def axes(kind: Kind, variant: str, m: int) -> dict:
    """A variant's own build keywords and their values, searched beside the shared ones (and over them where named
    alike): the int-group stream's accumulators (one or a field's each), the GGUF stream's step (chunks), the int-group
    mmq's tiles (block_m up to m's bucket, block_n MMQ_BLOCK_N, 4 or 8 warps, swap only)."""
    if variant == "mmq":
        rows = bucket(kind, m)
        return dict(block_m=tuple(b for b in MMQ_BLOCK_M if b <= rows), block_n=MMQ_BLOCK_N, num_warps=(4, 8),
                    swap=(True,))
    if variant != "stream":
        return {}
    return dict(accs=(1, 32 // kind.bits)) if kind.bits else dict(chunks=CHUNKS)


def builds(block_m: int, quick: bool, extra: dict | None = None) -> list[dict]:
    """The keywords that change a build (split_k does not, beyond split 1 against more); extra: a variant's axes."""
    out = [dict(block_m=block_m, block_n=bn, num_stages=ns, num_warps=8 if bn == 128 else 4, swap=True)
           for bn, ns in itertools.product(BLOCK_N, (3,) if quick else STAGES)]
    out += [dict(block_m=block_m, block_n=64, num_stages=3, num_warps=4, swap=False)]
    for key, values in (extra or {}).items():
        out = [dict(b, **{key: v}) for b in out for v in values]
    return list({_build_key(b): b for b in out}.values())  # (extra's axes may make builds alike)


def _build_key(cfg: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in cfg.items() if k != "split_k"))


def call(kind: Kind, variant: str, x, w, y, cfg: dict):
    if kind.bits:
        return igm.int_group_matmul(x, w, kind.bits, kind.group, out=y, target=TARGET, variant=variant, **cfg)
    return dgm.dequant_matmul(x, w, kind.name, out=y, target=TARGET, variant=variant, **cfg)


def weights(torch, kind: Kind, n: int, k: int, seed: int):
    """Random valid blocks on DEVICE: GGUF as tools.kernel_cases makes them; integer groups as words (q fields any
    bits, fp32 scales near 1 / sqrt(k), biases), the layout ir/formats/int_groups.py packs."""
    from tools.kernel_case_base import Dev
    from tools.kernel_cases import gguf_weights

    d = Dev(seed, DEVICE)
    if not kind.bits:
        return gguf_weights(d, kind.name, n, k)
    groups, bw = k // kind.group, 2 + kind.group * kind.bits // 32
    words = torch.randint(-2**31, 2**31 - 1, (n, groups, bw), dtype=torch.int32, device=DEVICE, generator=d.gen)
    scale = torch.rand((n, groups), device=DEVICE, generator=d.gen) * 2 / (1 << kind.bits) / k**0.5 + 1e-4
    words[:, :, 0] = scale.view(torch.int32)
    words[:, :, 1] = (-scale * (1 << (kind.bits - 1))).view(torch.int32)
    return words.view(n, groups * bw)


def reference(kind: Kind, x, w) -> np.ndarray:
    x, w = x.float().cpu().numpy(), w.cpu().numpy()
    if kind.bits:
        return igm.int_group_matmul_ref(x, w, kind.bits, kind.group)
    return dgm.dequant_matmul_ref(x, w, kind.name)


def check(job) -> tuple:
    """Worker: one build at split 1 and 2 on a small problem against the reference; (job, max relative error)."""
    name, variant, m, cfg = job
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    kind = parse_kind(name)
    w = weights(torch, kind, CHECK_N, CHECK_K, seed=m)
    x = torch.randn((m, CHECK_K), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(m)).bfloat16()
    want = reference(kind, x, w)
    err = 0.0
    for split in (1, 2):
        y = torch.full((m, CHECK_N), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        try:
            call(kind, variant, x, w, y, dict(cfg, split_k=split))
        except Exception as e:  # a build the compiler refuses (shared memory, registers) is out of the sweep
            return job, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        got = y.float().cpu().numpy().astype(np.float64)
        e = float(np.abs(got - want).max() / np.abs(want).max()) if np.isfinite(got).all() else np.inf
        err = max(err, e)
    return job, err


def _job_key(job) -> tuple:
    name, variant, m, cfg = job
    return name, variant, m, _build_key(cfg)


def _setup(seed: int = 0):
    """(torch, weights(qtype, n, k)) on the GPU, for tools.sweep_mmq."""
    import torch

    from tools.kernel_case_base import Dev
    from tools.kernel_cases import gguf_weights

    d = Dev(seed, "cuda")
    return torch, lambda q, n, k: gguf_weights(d, q, n, k)


def _time(torch, fn) -> float:
    """us of fn: the median of CUDA-graph replays."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median")


BENCH = _time  # us of a call (a CPU test puts a fake clock here)


def search(bench, run, start: dict, ok, axes: dict | None = None,
           extra: dict | None = None) -> tuple[dict, float, float, int]:
    """Coordinate search from `start` (each keyword of `axes`, by default block_n, num_stages, split_k and swap, then
    extra's, in turn over its values, keeping the best; num_warps follows block_n: 8 for 128): (best, its us,
    start's us, settings timed)."""
    seen: dict = {}

    def t(cfg):
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen[key] = bench(lambda: run(cfg))
        return seen[key]

    best, good = dict(start), ok(start)
    base = t(best) if good else float("nan")  # own tiles that failed the check are not timed
    axes = dict(axes or dict(block_n=BLOCK_N, num_stages=STAGES, split_k=SPLITS, swap=(True, False)), **(extra or {}))
    for key, values in axes.items():
        for v in values:
            cand = dict(best, **{key: v})
            if key == "block_n":
                cand["num_warps"] = 8 if v == 128 else 4
            if ok(cand) and (not good or t(cand) < t(best)):
                best, good = cand, True
    return (best, t(best), base, len(seen)) if good else ({}, float("nan"), base, len(seen))


@dataclass
class Result:
    kind: Kind
    m: int
    n: int
    k: int
    variant: str
    best: dict
    us: float
    base: float  # the launcher's own tiles
    pct: float  # of copy bandwidth: W, x and y once


def _search_one(kind: Kind, v: str, m: int, k: int, xws: tuple, bench, bad: set, quick: bool):
    """One variant's coordinate search on one problem over the checked builds, each call through every weight copy
    in turn: (best, its us a GEMM, own tiles' us)."""
    allowed = {_build_key(b) for b in builds(bucket(kind, m), quick, axes(kind, v, m))}
    x, ws, y = xws

    def ok(c):
        return (_build_key(c) in allowed and (kind.name, v, m, _build_key(c)) not in bad
                and k // 128 // c["split_k"] >= 2)

    def run(c):
        for w in ws:
            call(kind, v, x, w, y, c)

    best, us, base, _ = search(bench, run, rule(kind, v, m, y.shape[1], k), ok, extra=axes(kind, v, m))
    return best, us / len(ws), base / len(ws)


def time_problems(problems, variants, bad: set, bench, budget: float, t0: float, gbps: float,
                  quick: bool = False) -> list:
    """Times each (problem, variant) until the budget is spent; those left get a Result with us = nan. Each timed
    call runs over enough weight copies (COLD_BYTES) that W is not found in L2."""
    import torch

    out = []
    for kind, m, n, k in problems:
        todo = [v for v in variants if v in kind.variants]
        if time.perf_counter() - t0 > budget:
            out += [Result(kind, m, n, k, v, {}, float("nan"), float("nan"), 0.0) for v in todo]
            continue
        w = weights(torch, kind, n, k, seed=n + k)
        wbytes = w.numel() * w.element_size()
        ws = [w] + [weights(torch, kind, n, k, seed=n + k + i) for i in range(1, -(-COLD_BYTES // wbytes))]
        x = torch.randn((m, k), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(m)).bfloat16()
        y = torch.empty((m, n), device=DEVICE, dtype=torch.bfloat16)
        nbytes = wbytes + 2 * (x.numel() + y.numel())
        for v in todo:
            best, us, base = _search_one(kind, v, m, k, (x, ws, y), bench, bad, quick)
            out.append(Result(kind, m, n, k, v, best, us, base, 100 * nbytes / us / 1e3 / gbps))
    return out


def report(results: list[Result], gbps: float) -> dict:
    """Prints the table, each problem's best and the TUNED literals; returns {problem: best result} for --json."""
    print(f"\ncopy {gbps:.0f} GB/s (read + write); bf16 x, CUDA-graph medians, us")
    print(f"{'type':9} {'M':>4} {'N x K':>11} {'variant':8} {'best':>8} {'own':>8} {'%copy':>6}  best tiles")
    for r in results:
        print(f"{r.kind.name:9} {r.m:4} {f'{r.n}x{r.k}':>11} {r.variant:8} {r.us:8.1f} {r.base:8.1f} {r.pct:6.1f}  "
              + (str(r.best) if r.best else "skipped: out of time" if r.base != r.base and not r.pct else
               "no setting passed the check"))
    best: dict = {}
    for r in results:
        key = (r.kind, r.m, r.n, r.k)
        if r.us == r.us and (key not in best or r.us < best[key].us):
            best[key] = r
    print("\n# best per problem (variant: its us against each variant's own-tiles us)")
    for (kind, m, n, k), r in best.items():
        own = {o.variant: round(o.base, 1) for o in results if (o.kind, o.m, o.n, o.k) == (kind, m, n, k)}
        print(f"#   {kind.name} M={m} {n}x{k}: {r.variant} {r.us:.1f} us ({r.pct:.1f}% of copy); own tiles {own}")
    for title, mine in (("kernels_src/dequant_gemm.py (qtype, row bucket, n, k)", False),
                        ("kernels_src/int_group_gemm.py (bits, group, row bucket, n, k)", True)):
        rows = [r for r in best.values() if bool(r.kind.bits) == mine]
        if not rows:
            continue
        print(f"\n# paste into {title}\nTUNED = {{")
        seen = set()
        for r in sorted(rows, key=lambda r: (r.kind.name, r.m, r.n, r.k)):
            b = bucket(r.kind, r.m)
            key = (r.kind.bits, r.kind.group, b, r.n, r.k) if mine else (r.kind.name, b, r.n, r.k)
            entry = dict(variant=r.variant, **r.best)
            lead = "#  (a smaller M's entry holds this bucket) " if key in seen else "    "
            seen.add(key)
            print(f"{lead}{key!r}: {entry!r},")
        print("}")
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="blocked,words,sub64,gather,stream,mmq",
                    help="kernel variants (dequant_gemm.VARIANTS, int_group_gemm.VARIANTS); each where it applies")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K of W")
    ap.add_argument("--qtypes", default=",".join(QTYPES), help="GGUF qtypes and intBgG (B bits, groups of G)")
    ap.add_argument("--quick", action="store_true", help="num_stages 3 builds only")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                    help="build processes (0: build and check in this one)")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds in all; problems past it are skipped")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    kinds = [parse_kind(t) for t in args.qtypes.split(",") if t.strip()]
    ms = parse_list(args.ms, "--ms")
    shapes = parse_list(args.shapes, "--shapes", parse_shape)
    known = set(dgm.VARIANTS) | set(igm.VARIANTS)
    variants = parse_list(args.variants, "--variants", str)
    if not variants or set(variants) - known:
        raise SystemExit(f"sweep_gemm: unknown variants {sorted(set(variants) - known)} (known: {sorted(known)})")
    for kind, (_n, k) in itertools.product(kinds, shapes):
        unit = kind.group if kind.bits else dgm.GGUF[kind.name].block_size
        if k % max(unit, 128):
            raise SystemExit(f"sweep_gemm: K {k} is not whole {kind.name} blocks of 128-input steps")
    jobs = sorted({(kind.name, v, m, _build_key(b)) for kind in kinds for v in variants if v in kind.variants
                   for m in ms for b in builds(bucket(kind, m), args.quick, axes(kind, v, m))})
    work = [(q, v, m, dict(b)) for q, v, m, b in jobs]
    if args.workers:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            checks = dict((_job_key(j), e) for j, e in pool.imap_unordered(check, work))
    else:  # in this process (a CPU test: the module's TARGET and DEVICE as set)
        checks = dict((_job_key(j), e) for j, e in map(check, work))
    bad = {job for job, e in checks.items() if not (isinstance(e, float) and e <= TOL)}
    worst = max((e for e in checks.values() if isinstance(e, float)), default=0.0)
    print(f"built and checked {len(jobs)} builds in {time.perf_counter() - t0:.0f} s; worst error {worst:.2e} of the "
          f"largest output (limit {TOL:g}); failed: {[(j[:3], dict(j[3]), checks[j]) for j in bad] or 'none'}")
    import torch

    from tools.bench_kernels import copy_gbps

    gbps = copy_gbps(torch, 2**30)
    problems = [(kind, m, n, k) for kind in kinds for m in ms for n, k in shapes]
    results = time_problems(problems, variants, bad, lambda fn: BENCH(torch, fn), args.budget, t0, gbps,
                            args.quick)
    best = report(results, gbps)
    if args.json:
        rows = [dict(type=r.kind.name, m=r.m, n=r.n, k=r.k, variant=r.variant, us=r.us, own_us=r.base, pct_copy=r.pct,
                     tiles=r.best, best=best.get((r.kind, r.m, r.n, r.k)) is r) for r in results]
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbps=gbps, failed=[str(j) for j in bad], results=rows), f, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
