"""Time the integer-group GEMM against cuBLAS on a CUDA GPU, where backends/cuda/int_group_linear picks between them:
`python -m tools.bench_int_group_gemm [--bits 4] [--group 128] [--rows 9,16,...] [--quick]`.

For Llama-3-8B's projections (N x K: qkv 6144 x 4096, o 4096 x 4096, gate/up 28672 x 4096, down 4096 x 14336), bf16 x,
at each row count: ours (int_group_matmul at default tiles), the dequantize path (W to bf16 in the runner's chunks,
then cuBLAS: what int_group_linear runs past int_group_gemm.MAX_ROWS), cuBLAS on a bf16 W (a dense model's time)
and, at 1-8 rows, the GEMV. Ours is checked against the numpy reference once a problem. Times are CUDA-graph
replays (tools/bench_kernels.time_calls) over enough weight copies that W never sits in L2; prints one table, ours /
the dequantize path's time last (below 1: ours wins). `--gemv-sweep [--quick] [--gemv-rows 1,4,8] [--gemv-tiles
all|default]` instead times the GEMV's two paths (int8 or fp32 x) over its tiles and the int8 path's loop forms
(gemv_sweep), and prints int_group_gemv.TUNED's literal."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (4, 8, 9, 16, 32, 64, 128, 256, 512, 2048)  # at 1-8 rows the GEMV (int_group_linear's path there) too
L2_BYTES = 60 * 2**20  # an H200's L2 (and more than an H100's): weight copies cover three times it


def _problem(torch, n: int, k: int, bits: int, group: int, copies: int):
    from tools.kernel_case_base import Dev
    from tools.kernel_cases_int_group import int_group_weights

    w = int_group_weights(Dev(n * 31 + k), n, k, bits, group)
    return [w] + [w.clone() for _ in range(copies - 1)]  # other addresses: no replay finds them in L2


def bench(torch, name: str, n: int, k: int, m: int, bits: int, group: int, ws: list) -> dict:
    from backends.cuda.linears import DEQUANT_CHUNK_BYTES
    from backends.cuda.torch_ops import dequantized_matmul
    from kernels_src.int_group_gemm import int_group_matmul, int_group_matmul_ref
    from kernels_src.int_group_gemv import MAX_ROWS, int_group_dequantize, int_group_gemv
    from tools.bench_kernels import time_calls
    from tools.kernel_case_base import compare, host

    x = torch.randn((m, k), device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
    y = int_group_matmul(x, ws[0], bits, group, target="triton")
    torch.cuda.synchronize()
    err, problem = compare("y", host(y[:, :64]), int_group_matmul_ref(host(x), host(ws[0][:64]), bits, group),
                           "bfloat16")
    dense = [int_group_dequantize(w, bits, group, k, dtype="bfloat16", target="triton") for w in ws]

    def ours():
        for w in ws:
            int_group_matmul(x, w, bits, group, out=y, target="triton")

    def dequantized():
        for w in ws:
            rows = lambda r0, r1, w=w: int_group_dequantize(w[r0:r1], bits, group, k, dtype="bfloat16",
                                                            target="triton")
            dequantized_matmul(x, n, k * 2, DEQUANT_CHUNK_BYTES, rows)

    def cublas():
        for wd in dense:
            torch.nn.functional.linear(x, wd)

    def gemv():
        for w in ws:
            int_group_gemv(x, w, bits, group, out=y, target="triton")

    fns = [("ours", ours), ("dequant+cublas", dequantized), ("cublas_bf16", cublas)]
    fns += [("gemv", gemv)] if m <= MAX_ROWS else []
    us = {key: time_calls(torch, fn, len(ws), contextlib.nullcontext, False)[0] for key, fn in fns}
    return dict(shape=name, n=n, k=k, m=m, **us, ratio=us["ours"] / us["dequant+cublas"], err=err,
                check=problem or "PASS")


GEMV_TILES = [(rows, lanes, warps) for rows in (1, 2, 4, 8) for lanes, warps in ((32, 1), (64, 1))]
LOOP_FORMS = ((False, 0), (True, 0), (False, 2), (False, 3))  # the int8 path's (prefetch, stages): gemv_loop.py
GAIN = 0.97  # a setting enters the printed TUNED when it takes at most this fraction of the default's time


def _gemv_settings(m: int, default: tuple, tiles: str = "all") -> list:
    """(int8 x, rows, lanes, warps, prefetch, stages) to time at m batch rows, the default first: 2-16 rows x batch
    rows (one row a program at one batch row reads too little at a time; more than 16 spill), 32 or 64 vectors a row
    and step, on both paths, the int8 path in each loop form; tiles "default": the default's tiles only."""
    grid = [default[1:4]] if tiles == "default" else [t for t in GEMV_TILES if 1 < t[0] * m <= 16]
    out = [(True, *t, *f) for t in grid for f in LOOP_FORMS] + [(False, *t, False, 0) for t in grid]
    return [default] + [s for s in out if s != default]


def gemv_sweep(torch, shapes: dict, bits: int, group: int, batches=(1, 4, 8), tiles: str = "all") -> dict:
    """The GEMV at `batches` rows, on int8 x (dp4a: the Triton default) and on fp32 x, over (rows a program, vectors a
    row and step, warps) and the int8 path's loop forms, checked against the reference once a setting; GB/s of W
    read, the default setting first and each better one after it, the best of each path last for each (shape,
    rows). Returns int_group_gemv.TUNED's entries (the int8 path's best where it beats the default by 3%)."""
    from kernels_src.int_group_gemv import default_tiles, int_group_gemv, int_group_gemv_ref
    from tools.bench_kernels import copy_gbps, time_calls
    from tools.kernel_case_base import compare, host

    copy = copy_gbps(torch, 2**30)
    print(f"copy {copy:.0f} GB/s (1 GiB, read + write); %copy below: W's bytes read over that", flush=True)
    print(f"{'shape':8} {'N x K':>12} {'M':>3} {'x':>4} {'rows':>4} {'lanes':>5} {'warps':>5} {'pf':>2} {'st':>2} "
          f"{'us':>8} {'GB/s':>7} {'%copy':>5}  check", flush=True)
    table = {}
    for name, (n, k) in shapes.items():
        g = k if group == -1 else group
        w_bytes = n * k * (bits + 64 / g) / 8
        ws = _problem(torch, n, k, bits, g, max(1, min(8, int(np.ceil(3 * L2_BYTES / w_bytes)))))
        for m in batches:
            x = torch.randn((m, k), device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
            y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            ref = int_group_gemv_ref(host(x), host(ws[0][:64]), bits, g)
            t = default_tiles(m, n)
            default = (True, t["ROWS"], t["LANES"], t["num_warps"], False, 0)
            best, timed = {}, {}
            for i8, rows, lanes, warps, pf, st in _gemv_settings(m, default, tiles):
                def run(i8=i8, rows=rows, lanes=lanes, warps=warps, pf=pf, st=st, x=x, y=y, g=g, ws=ws):
                    for w in ws:
                        int_group_gemv(x, w, bits, g, out=y, rows=rows, lanes=lanes, num_warps=warps, int8_x=i8,
                                       target="triton", **({"prefetch": pf, "stages": st} if i8 else {}))
                run()
                torch.cuda.synchronize()
                _, problem = compare("y", host(y[:, :64]), ref, "bfloat16")
                us = time_calls(torch, run, len(ws), contextlib.nullcontext, False)[0]
                s = (i8, rows, lanes, warps, pf, st)
                timed[s] = us
                better = not problem and (i8 not in best or us < best[i8][0])
                if s == default or better or (pf or st) and (i8, rows, lanes, warps, False, 0) == default:
                    print(f"{name:8} {f'{n}x{k}':>12} {m:3} {'int8' if i8 else 'fp32':>4} {rows:4} {lanes:5} "
                          f"{warps:5} {pf:2d} {st:2d} {us:8.1f} {w_bytes / us / 1e3:7.0f} "
                          f"{100 * w_bytes / us / 1e3 / copy:5.0f}  {problem or 'PASS'}"
                          f"{' (default)' if s == default else ''}", flush=True)
                if better:
                    best[i8] = (us, s)
            for i8, (us, s) in best.items():
                print(f"{name:8} {f'{n}x{k}':>12} {m:3} best {'int8' if i8 else 'fp32'}: rows {s[1]}, lanes {s[2]}, "
                      f"{s[3]} warps, prefetch {s[4]}, stages {s[5]}, {us:.1f} us, {w_bytes / us / 1e3:.0f} GB/s",
                      flush=True)
            if True in best and best[True][0] <= GAIN * timed[default]:
                s = best[True][1]
                table[(bits, g, m, n, k)] = dict(ROWS=s[1], LANES=s[2], num_warps=s[3], prefetch=s[4], stages=s[5])
        del ws
        torch.cuda.empty_cache()
    print(f"\n# the int8 path's best where it beats the default by {100 * (1 - GAIN):.0f}% or more: for "
          "int_group_gemv.TUNED (those not listed take default_tiles)\nTUNED = {")
    for key, tiles_ in table.items():
        print(f"    {key!r}: {tiles_},")
    print("}")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_int_group_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=128, help="inputs a group (the row length K for -1)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--quick", action="store_true",
                   help="two shapes (o, down), 16 and 256 rows; with --gemv-sweep: gate_up and down")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="instead: the GEMV's paths (int8 or fp32 x), (rows, lanes, warps) and the int8 path's loop "
                   "forms (prefetch, stages) at --gemv-rows rows")
    p.add_argument("--gemv-rows", default="1,4,8", help="with --gemv-sweep: batch rows, comma-separated, 1-8")
    p.add_argument("--gemv-tiles", choices=("all", "default"), default="all",
                   help="with --gemv-sweep: every (rows, lanes, warps), or the default's only (in each loop form)")
    a = p.parse_args(argv)
    import torch

    if a.gemv_sweep:
        batches = tuple(int(r) for r in a.gemv_rows.split(",") if r.strip())
        if not batches or not all(1 <= r <= 8 for r in batches):
            p.error(f"--gemv-rows {a.gemv_rows}: batch rows from 1 to 8")
        gemv_sweep(torch, {s: SHAPES[s] for s in (("gate_up", "down") if a.quick else SHAPES)}, a.bits, a.group,
                   batches, a.gemv_tiles)
        return 0

    rows = (16, 256) if a.quick else tuple(int(r) for r in a.rows.split(","))
    shapes = {s: SHAPES[s] for s in (("o", "down") if a.quick else SHAPES)}
    print(f"{'shape':8} {'N x K':>12} {'M':>5} {'ours us':>9} {'deq+cuBLAS us':>13} {'cuBLAS bf16 us':>14} "
          f"{'GEMV us':>8} {'ours/deq':>8}  check", flush=True)
    for name, (n, k) in shapes.items():
        group = k if a.group == -1 else a.group
        w_bytes = n * k * (a.bits + 64 / group) / 8
        ws = _problem(torch, n, k, a.bits, group, max(1, min(8, int(np.ceil(3 * L2_BYTES / w_bytes)))))
        for m in rows:
            r = bench(torch, name, n, k, m, a.bits, group, ws)
            gemv = f"{r['gemv']:8.1f}" if "gemv" in r else f"{'-':>8}"
            print(f"{name:8} {f'{n}x{k}':>12} {m:5} {r['ours']:9.1f} {r['dequant+cublas']:13.1f} "
                  f"{r['cublas_bf16']:14.1f} {gemv} {r['ratio']:8.2f}  {r['check']} (rel err {r['err']:.1e})",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
