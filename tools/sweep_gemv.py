"""Time dequant_gemv over tile settings on a CUDA GPU for the GEMVs a GGUF Llama-3-8B decode step runs; print the
best per problem as a TUNED literal for kernels_src/dequant_gemv.py, and what each file's GEMVs cost a step.

    python -m tools.sweep_gemv [--files q4km,q5km,q8_0] [--shapes Q4_K:4096x14336,...] [--types Q4_K]
                               [--batches 1] [--budget 150] [--quick]

Problems (qtype, N x K): by default those of tools/gemv_shapes for --files (llama.cpp's types, q/k/v and gate/up
fused where their types agree), the largest share of a step first; --shapes names others. Settings: the rule's
tiles (for Q4_K, Q5_K and Q6_K, whose default is int8 x, also on the fp32-x path; for Q6_K also with W read as 32-bit
words, the `words` column, and TUNED's entry likewise) and TUNED's entry first, each of those two also in the K
loop's other forms (LOOP_FORMS, kernels_src/gemv_loop.py: the next step's W prefetched in registers, the `prefetch`
column, or Triton's pipelining over 2 or 3 stages, `stages 2`, `stages 3`), then ROWS 1-8
a program x (PARTS, warps, STEP: one or two lane passes a step) on the fp32-x kernel, or for those three the
int8 path's (STEP 4-16, warps) and the fp32 path at its best parts. bf16 x, CUDA-graph replays
(triton.testing.do_bench_cudagraph) cycling over enough weight copies that none is found in L2; int8 x times include
its quantize_x pass, as the runner runs it. Every setting is compiled and checked against dequant_gemv_ref first, in
worker processes (they fill Triton's on-disk cache), so the timing pass only replays; the essentials are timed for
every problem before the other settings, which stop at --budget seconds (from the start).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from kernels_src.dequant_gemv import TILE_KEYS

TARGET, DEVICE = "triton", "cuda"  # (a CPU test runs the sweep's code on the DSL interpreter)
CHECK_N, CHECK_K = 48, 4096  # the check's problem: sizes divisible by 16, as Triton specializes the timed ones
GAIN = 0.97  # a setting enters the printed table when it takes at most this fraction of the rule's time
INT8_STEPS = ((4, 1), (8, 1), (16, 1), (8, 2), (16, 2))  # (STEP, warps) of the int8 path: 1-2 blocks a lane
LOOP_FORMS = ({"prefetch": True}, {"stages": 2}, {"stages": 3})  # the K loop's forms beside the plain one
# Settings of more rows x batch rows take no other loop form: at 8 the prefetch spills (Q6_K: 255 registers), and
# Triton's compile of the pipelined loop takes 40 s (Q4_K, stages 3) to over 15 min (Q6_K words) on a CPU core.
FORM_ROWS = 4


def rows_for(m: int) -> tuple[int, ...]:
    """ROWS a program at M batch rows (a lane holds M x ROWS accumulators)."""
    return (1, 2, 4, 8) if m == 1 else (1, 2, 4) if m <= 4 else (1, 2)


def essentials(qtype: str, m: int, n: int, k: int) -> list[dict]:
    """The rule's tiles for the problem (and on the fp32 path too where the int8 one is the default, and with W read
    as words where that path has a word loader), and TUNED's where it lists the problem (and its words twin); then
    each of those but the fp32-x twin in each of LOOP_FORMS (up to FORM_ROWS rows x batch rows)."""
    from kernels_src.dequant_gemv import TUNED, rule_tiles
    from kernels_src.dequant_gemv_i8 import WORD_LOADS, uses_int8

    out = [rule_tiles(qtype, m, n)]
    if uses_int8(qtype, TARGET):
        out.append(out[0] | {"int8_x": False})
        if qtype in WORD_LOADS:
            out.append(out[0] | {"words": True})
    tuned = TUNED.get((qtype, m, n, k))
    if tuned is not None:
        more = [dict(tuned)]
        if qtype in WORD_LOADS and "words" not in tuned and uses_int8(qtype, TARGET, tuned.get("int8_x")):
            more.append(dict(tuned) | {"words": True})
        out += [s for s in more if s not in out]
    fp32_twin = out[0] | {"int8_x": False}  # the rule's on the other path: a reference column, in no other form
    forms = [{key: v for key, v in s.items() if key not in ("prefetch", "stages")} | f
             for s in out if s != fp32_twin and s["ROWS"] * m <= FORM_ROWS for f in LOOP_FORMS]
    return out + [s for s in map(_s, dict.fromkeys(map(_t, forms))) if s not in out]


def settings(qtype: str, m: int, n: int, k: int, quick: bool = False) -> list[dict]:
    """The essentials, then the space: ROWS x (STEP, PARTS, warps), each valid by check_tiles; where int8 x is the
    default, its (STEP, warps) and the fp32 path's best-parts combinations."""
    from kernels_src.dequant_gemv import BEST_PARTS, LANES, MAX_PARTS, check_tiles
    from kernels_src.dequant_gemv_i8 import uses_int8

    out = essentials(qtype, m, n, k)
    if quick:
        return out
    fp32 = lambda p, w, f, **kw: dict(STEP=32 * w * p * f // LANES[qtype], PARTS=p, num_warps=w, **kw)
    pairs = ((1, 1), (2, 1), (1, 2))  # (warps, lane passes a step)
    if uses_int8(qtype, TARGET):  # PARTS unused there: 1
        combos = [dict(STEP=st, PARTS=1, num_warps=w) for st, w in INT8_STEPS]
        combos += [fp32(BEST_PARTS[qtype], w, f, int8_x=False) for w, f in pairs]
    else:
        parts = [p for p in (1, 2, 4) if MAX_PARTS[qtype] % p == 0 and (m <= 2 or p <= 2)]
        combos = [fp32(p, w, f) for p in parts for w, f in pairs] + [fp32(out[0]["PARTS"], 4, 1)]
    for r, c in itertools.product(rows_for(m), combos):
        s = dict(ROWS=r, **c)
        if s not in out:
            check_tiles(qtype, s)
            out.append(s)
    return out


def _kw(s: dict) -> dict:
    keys = {"ROWS": "rows", "STEP": "step", "PARTS": "parts", "num_warps": "num_warps", "int8_x": "int8_x",
            "words": "words", "prefetch": "prefetch", "stages": "stages"}
    kw = {keys[k]: v for k, v in s.items()}
    if kw.get("words"):  # the word loaders are the int8 path's: not TUNED's fp32 choice for the problem, if any
        kw.setdefault("int8_x", True)
    return kw


_OPTIONAL = ("int8_x", "words", "prefetch", "stages")  # keys a setting may leave out (the default then)


def _t(s: dict) -> tuple:
    """A setting as a key: (ROWS, STEP, PARTS, num_warps, then int8_x, words, prefetch, stages or None)."""
    return (*(s[k] for k in TILE_KEYS), *(s.get(k) for k in _OPTIONAL))


def _s(t: tuple) -> dict:
    s = dict(zip(TILE_KEYS, t[:4], strict=True))
    return s | {key: v for key, v in zip(_OPTIONAL, t[4:], strict=True) if v is not None}


def _check(job) -> str | None:
    """Compile (into Triton's cache) and check one setting on a small case: None, or what was wrong."""
    try:
        return _check_one(*job)
    except Exception as e:  # noqa: BLE001 - a setting that fails to build or run is reported, the rest go on
        return f"{type(e).__name__}: {str(e)[:300]}"


def _check_one(qtype: str, m: int, s: dict, n: int = CHECK_N, k: int = CHECK_K) -> str | None:
    import numpy as np
    import torch

    from kernels_src.dequant_gemv import dequant_gemv, dequant_gemv_ref
    from kernels_src.dequant_gemv_i8 import int8_error_bound, uses_int8
    from tools.kernel_case_base import Dev, host
    from tools.kernel_cases import gguf_weights

    d = Dev(1, DEVICE)
    w, x = gguf_weights(d, qtype, n, k), d.randn((m, k), torch.bfloat16)
    y = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    dequant_gemv(x, w, qtype, out=y, target=TARGET, **_kw(s))
    got, xh, wh = host(y).astype(np.float32), host(x).astype(np.float32), host(w)
    want = dequant_gemv_ref(xh, wh, qtype)
    i8 = int8_error_bound(xh, wh, qtype) if uses_int8(qtype, TARGET, s.get("int8_x")) else 0
    bad = ~(np.abs(got - want) <= i8 + 1e-2 * np.abs(want) + 1e-3 * np.abs(want).max())
    return f"{bad.sum()} of {bad.size} outputs off (max |dy| {np.nanmax(np.abs(got - want)):.3g})" if bad.any() \
        else None


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """'Q4_K:4096x14336,Q6_K:1024x4096' -> [(qtype, N, K)], each checked: a known type, K whole blocks."""
    from ir.formats.gguf_quants import QTYPES as GGUF
    from kernels_src.dequant_gemv import QTYPES

    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        q, _, nk = item.partition(":")
        n, _, k = nk.lower().partition("x")
        q = q.upper()
        if q not in QTYPES or not (n.isdigit() and k.isdigit()) or int(k) % GGUF[q].block_size or not int(n):
            raise SystemExit(f"--shapes {item!r}: want QTYPE:NxK with QTYPE of {', '.join(QTYPES)} and K a multiple "
                             "of its block")
        out.append((q, int(n), int(k)))
    return out


def problems_for(files: list[str], shapes: str, types: str) -> tuple[list, dict]:
    """([(qtype, N, K)] to time, {file: Counter of the GEMVs a step runs}) from the command line's choices."""
    from tools.gemv_shapes import FILES, step_gemvs

    bad = [f for f in files if f not in FILES]
    if bad:
        raise SystemExit(f"--files {','.join(bad)}: known files are {', '.join(FILES)}")
    steps = {f: step_gemvs(f) for f in files}
    if shapes:
        probs = parse_shapes(shapes)
    else:  # the largest share of a step first (the budget may end the sweep's later problems)
        from ir.formats.gguf_quants import row_bytes

        share = Counter()
        for c in steps.values():
            share.update({(q, n, k): cnt * n * row_bytes(q, k) for (q, n, k), cnt in c.items()})
        probs = sorted(share, key=share.get, reverse=True)
    keep = {q.strip().upper() for q in types.split(",") if q.strip()}
    return [p for p in probs if not keep or p[0] in keep], steps


def _jobs(probs, batches, quick: bool) -> list[tuple]:
    """One check a binary: (qtype, M, setting); N and K take the same binary (Triton specializes on 16 | size)."""
    return list(dict.fromkeys((q, m, _t(s)) for q, n, k in probs for m in batches
                              for s in settings(q, m, n, k, quick)))


class Problem:
    """One (qtype, M, N, K): its weight copies, inputs, and the times of the settings timed on it."""

    def __init__(self, torch, d, ws, qtype: str, m: int, k: int):
        self.qtype, self.m, self.n, self.k = qtype, m, ws[0].shape[0], k
        self.ws = itertools.cycle(ws)
        self.x = d.randn((m, k), torch.bfloat16)
        self.y = torch.empty((m, self.n), device=self.x.device, dtype=torch.bfloat16)
        self.us: dict[tuple, float] = {}

    @property
    def key(self) -> tuple:
        return self.qtype, self.m, self.n, self.k

    def call(self, s: dict):
        from kernels_src.dequant_gemv import dequant_gemv

        kw = _kw(s)
        return lambda: dequant_gemv(self.x, next(self.ws), self.qtype, out=self.y, target=TARGET, **kw)


def _time(probs: list[Problem], problems: dict, bench, budget: float, t0: float, quick: bool) -> int:
    """Essentials (the rule, TUNED's entry) of every problem first, then the rest in the problems' order until the
    budget: the number of settings left untimed."""
    ok = lambda p, s: not problems.get((p.qtype, p.m, _t(s)))
    for p in probs:
        for s in essentials(*p.key):
            if ok(p, s):
                p.us[_t(s)] = bench(p.call(s))
    print(f"essentials timed at {time.perf_counter() - t0:.0f} s", flush=True)
    skipped = 0
    for p in probs:
        for s in settings(*p.key, quick)[len(essentials(*p.key)):]:
            if time.perf_counter() - t0 > budget:
                skipped += 1
            elif ok(p, s):
                p.us[_t(s)] = bench(p.call(s))
    return skipped


def _form(f: dict) -> str:
    """A loop form's column head: prefetch, stages 2, ..."""
    return " ".join("prefetch" if k == "prefetch" else f"{k} {v}" for k, v in f.items())


def step_us(gemvs, us: dict) -> float:
    """A step's GEMV time at M = 1 from {(qtype, 1, N, K): us} and the step's Counter of (qtype, N, K)."""
    return sum(us[(q, 1, n, k)] * c for (q, n, k), c in gemvs.items())


def _report(probs: list[Problem], gbps: float, steps: dict) -> dict:
    """Print a row per problem and each file's GEMV time a step at M = 1; return the table to paste."""
    from ir.formats.gguf_quants import row_bytes
    from kernels_src.dequant_gemv import TUNED

    nan = float("nan")
    print(f"\n{'type':5} {'M':>1} {'N x K':>12} {'rule us':>8} {'fp32-x':>8} {'words':>8} "
          + "".join(f"{'/'.join(map(str, f.values())) if len(f) > 1 else _form(f):>9}" for f in LOOP_FORMS)
          + f" {'tuned us':>8} {'best us':>8} {'GB/s':>6} {'%copy':>5}  best (ROWS, STEP, PARTS, warps, int8_x, "
          "words, prefetch, stages)")
    table, best_us, rule_us, plain_us = {}, {}, {}, {}
    for p in probs:
        if not p.us:
            continue
        ess = essentials(*p.key)
        rule = p.us.get(_t(ess[0]), nan)
        fp32 = p.us.get(_t(ess[1]), nan) if len(ess) > 1 and ess[1].get("int8_x") is False else nan
        words = p.us.get(_t(ess[0] | {"words": True}), nan)  # the rule's tiles with W read as words
        forms = "".join(f"{p.us.get(_t(ess[0] | f), nan):9.2f}" for f in LOOP_FORMS)  # and in the loop's forms
        tuned = p.us.get(_t(TUNED[p.key]), nan) if p.key in TUNED else nan
        best = min(p.us, key=p.us.get)
        us = p.us[best]
        gb = (p.n * row_bytes(p.qtype, p.k) + 2 * p.m * (p.n + p.k)) / us / 1e3
        print(f"{p.qtype:5} {p.m:>1} {f'{p.n}x{p.k}':>12} {rule:8.2f} {fp32:8.2f} {words:8.2f}{forms} "
              f"{tuned:8.2f} {us:8.2f} {gb:6.0f} {100 * gb / gbps:5.1f}  {best}")
        best_us[p.key], rule_us[p.key] = us, rule
        plain_us[p.key] = min((v for t, v in p.us.items() if not _s(t).get("prefetch") and not _s(t).get("stages")),
                              default=nan)
        if us <= GAIN * rule:
            table[p.key] = _s(best)
    for f, gemvs in steps.items():
        if all((q, 1, n, k) in best_us for q, n, k in gemvs):
            print(f"{f}: {sum(gemvs.values())} GEMVs a step at M = 1: {step_us(gemvs, rule_us):.0f} us at the "
                  f"rule's tiles, {step_us(gemvs, plain_us):.0f} us at the best with the plain loop, "
                  f"{step_us(gemvs, best_us):.0f} us at the best")
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", default="q4km,q5km,q8_0", help="GGUF files whose GEMVs to sweep (gemv_shapes)")
    ap.add_argument("--shapes", default="", help="instead: QTYPE:NxK,... (e.g. Q4_K:4096x14336)")
    ap.add_argument("--types", default="", help="only these GGUF types, comma-separated")
    ap.add_argument("--batches", default="1", help="rows M, comma-separated, 1-8")
    ap.add_argument("--quick", action="store_true", help="the rule's and TUNED's tiles only")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; settings past the essentials stop there")
    ap.add_argument("--json", type=Path, help="also write the table here, for LLM_ENGINE_GEMV_TUNED=FILE (a GPU's own "
                    "tiles over the built-in ones, without editing the code)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or any(not 1 <= m <= 8 for m in batches):
        raise SystemExit(f"--batches {args.batches}: rows from 1 to 8")
    probs, steps = problems_for([f.strip() for f in args.files.split(",") if f.strip()], args.shapes, args.types)
    import torch
    import triton
    import triton.testing

    from ir.formats.gguf_quants import row_bytes
    from tools.bench_kernels import copy_gbps
    from tools.kernel_case_base import Dev
    from tools.kernel_cases import gguf_weights

    jobs = _jobs(probs, batches, args.quick)
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        checks = pool.map(_check, [(q, m, _s(t)) for q, m, t in jobs])
        problems = dict(zip(jobs, checks, strict=True))
    print(f"compiled and checked {len(jobs)} settings in {time.perf_counter() - t0:.0f} s", flush=True)
    gbps = copy_gbps(torch, 2**30)
    print(f"copy {gbps:.0f} GB/s; {torch.cuda.get_device_name()}", flush=True)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    d = Dev(2, DEVICE)
    timed = []
    for q, n, k in probs:  # all weights made first (a few GB), so that every problem's essentials come first
        ws = [gguf_weights(d, q, n, k) for _ in range(max(2, -(-3 * l2 // (n * row_bytes(q, k)))))]
        timed += [Problem(torch, d, ws, q, m, k) for m in batches]
    bench = lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=3, return_mode="median")
    skipped = _time(timed, problems, bench, args.budget, t0, args.quick)
    table = _report(timed, gbps, {f: c for f, c in steps.items() if not args.shapes})
    for key, why in problems.items():
        if why:
            print(f"WRONG {key}: {why}")
    if skipped:
        print(f"({skipped} settings past --budget {args.budget:.0f} s not timed)")
    print(f"\n# the best settings by (qtype, M, N, K) where they beat the rule's by {100 * (1 - GAIN):.0f}% or more "
          f"({time.perf_counter() - t0:.0f} s): for dequant_gemv.TUNED, in place of its entries for the swept problems "
          "(those not listed take the rule)")
    print("TUNED = {")
    for key, s in table.items():
        print(f"    {key!r}: {s},")
    print("}")
    if args.json:
        args.json.write_text(json.dumps([[list(key), s] for key, s in table.items()]))
        print(f"wrote {args.json}: LLM_ENGINE_GEMV_TUNED={args.json} puts it over dequant_gemv.TUNED")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
