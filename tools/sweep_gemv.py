"""Time dequant_gemv for every GGUF type over a few tile settings on a CUDA GPU; print the best per type.

    python -m tools.sweep_gemv [--quick] [--budget 80]

Each type at M = 1 and 8 on 14336 x 4096 and 4096 x 14336 (N x K), bf16 x, CUDA-graph replays
(triton.testing.do_bench_cudagraph) cycling over enough weight copies that none is found in L2. Every setting is
first checked against dequant_gemv_ref on a small case. The kernels are compiled up front in worker processes (they
fill Triton's on-disk cache), so the timing pass only replays. The last lines are a dict literal of the best
setting per (type, M) at 14336 x 4096, in default_tiles' keys.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context

SHAPES = ((14336, 4096), (4096, 14336))
BATCHES = (1, 8)


def settings(qtype: str, m: int) -> list[dict]:
    """The default tiles, then alternatives: other rows a program, parts a lane, warps a program (STEP follows)."""
    from kernels_src.dequant_gemv import LANES, default_tiles

    base = default_tiles(qtype, m, 14336)
    out = [base]
    alts = [dict(ROWS=r) for r in (2, 8)] if m == 1 else [dict(ROWS=2)]
    alts += ([dict(PARTS=p) for p in (1, 2, 4)] if m == 1 else []) + [dict(num_warps=2)]
    for alt in alts:
        s = base | alt
        s["STEP"] = 32 * s["num_warps"] * s["PARTS"] // LANES[qtype]
        words = 8 if qtype in ("Q4_K", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1") else 16  # a block's 4-word vectors x4
        if s not in out and s["STEP"] >= 1 and words % (4 * s["PARTS"]) == 0 and (m == 1 or s["PARTS"] <= 2):
            out.append(s)
    if qtype == "Q4_K":  # its default is the int8-activation path; the fp32 kernel as an alternative
        out.append(base | {"int8_x": False})
    return out


def _kw(s: dict) -> dict:
    keys = {"ROWS": "rows", "STEP": "step", "PARTS": "parts", "num_warps": "num_warps", "int8_x": "int8_x"}
    return {keys[k]: v for k, v in s.items()}


def _check(job) -> str | None:
    """Compile (into Triton's cache) and check one setting on a small case: None, or what was wrong."""
    try:
        return _check_one(*job)
    except Exception as e:  # noqa: BLE001 - a setting that fails to build or run is reported, the rest go on
        return f"{type(e).__name__}: {str(e)[:300]}"


def _check_one(qtype: str, m: int, s: dict) -> str | None:
    import numpy as np
    import torch

    from kernels_src.dequant_gemv import dequant_gemv, dequant_gemv_ref
    from kernels_src.dequant_gemv_i8 import int8_error_bound
    from tools.kernel_case_base import Dev
    from tools.kernel_cases import gguf_weights

    d = Dev(1, "cuda")
    n, k = 48, 4096  # sizes and strides divisible by 16, as in the timed shapes: Triton specializes on that
    w, x = gguf_weights(d, qtype, n, k), torch.randn((m, k), device="cuda").bfloat16()
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    dequant_gemv(x, w, qtype, out=y, target="triton", **_kw(s))
    got, xh, wh = y.float().cpu().numpy(), x.float().cpu().numpy(), w.cpu().numpy()
    want = dequant_gemv_ref(xh, wh, qtype)
    i8 = qtype == "Q4_K" and s.get("int8_x", True)
    tol = (int8_error_bound(xh, wh, qtype) if i8 else 0) + 1e-2 * np.abs(want) + 1e-3 * np.abs(want).max()
    bad = ~(np.abs(got - want) <= tol)
    return f"{bad.sum()} of {bad.size} outputs off (max |dy| {np.nanmax(np.abs(got - want)):.3g})" if bad.any() \
        else None


def _launch(gemv, x, ws, qtype: str, y, kw: dict) -> None:
    gemv(x, next(ws), qtype, out=y, target="triton", **kw)  # the next weight copy: each captured call its own


def copy_gbps(torch, triton) -> float:
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()  # 1 GiB, read and written
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=20, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="default tiles only")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds; later timings are skipped past it")
    ap.add_argument("--types", default="", help="comma-separated subset of the GGUF types")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch
    import triton
    import triton.testing

    from ir.formats.gguf_quants import row_bytes
    from kernels_src.dequant_gemv import QTYPES, dequant_gemv
    from tools.kernel_case_base import Dev
    from tools.kernel_cases import gguf_weights

    qtypes = [q.upper() for q in args.types.split(",") if q] or list(QTYPES)
    jobs = [(q, m, s) for q in qtypes for m in BATCHES for s in (settings(q, m)[:1] if args.quick else settings(q, m))]
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        problems = dict(zip(map(repr, jobs), pool.map(_check, jobs), strict=True))
    print(f"compiled and checked {len(jobs)} settings in {time.perf_counter() - t0:.0f} s", flush=True)
    gbps = copy_gbps(torch, triton)
    print(f"copy {gbps:.0f} GB/s; {torch.cuda.get_device_name()}", flush=True)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    d = Dev(2, "cuda")
    rows, best = [], {}
    for q in qtypes:
        for n, k in SHAPES:
            nbytes = n * row_bytes(q, k)
            sets = max(2, -(-3 * l2 // nbytes))
            ws = [gguf_weights(d, q, n, k) for _ in range(sets)]
            for m in BATCHES:
                x = torch.randn((m, k), device="cuda").bfloat16()
                y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
                moved = nbytes + 2 * m * (k + n)
                timed = []
                for s in (settings(q, m)[:1] if args.quick else settings(q, m)):
                    if problems[repr((q, m, s))] or (timed and time.perf_counter() - t0 > args.budget):
                        continue
                    us = 1e3 * triton.testing.do_bench_cudagraph(
                        partial(_launch, dequant_gemv, x, itertools.cycle(ws), q, y, _kw(s)), rep=5,
                        return_mode="median")
                    timed.append((us, s))
                if not timed:
                    continue
                us, s = min(timed, key=lambda t: t[0])
                default_us = timed[0][0] if timed[0][1] == settings(q, m)[0] else float("nan")
                rows.append((q, m, f"{n}x{k}", s, us, 100 * moved / us / 1e3 / gbps, default_us))
                if (n, k) == SHAPES[0]:
                    best[(q, m)] = s
            del ws
    print(f"\n{'type':5} {'M':>2} {'N x K':>10} {'us':>7} {'%copy':>6} {'default us':>10}  best setting")
    for q, m, shape, s, us, pct, dus in rows:
        print(f"{q:5} {m:>2} {shape:>10} {us:7.2f} {pct:6.1f} {dus:10.2f}  {s}")
    for key, why in problems.items():
        if why:
            print(f"WRONG {key}: {why}")
    print(f"\n# best per (type, M) at 14336 x 4096 ({time.perf_counter() - t0:.0f} s)")
    print("BEST_TILES = {")
    for (q, m), s in best.items():
        print(f"    ({q!r}, {m}): {s!r},")
    print("}")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
