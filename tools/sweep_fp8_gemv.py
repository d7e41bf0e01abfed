"""Time fp8_gemv over tiles and its K loop's forms on a CUDA GPU for Llama-3-8B's projections at decode's rows; print
the best per problem as a TUNED literal for kernels_src/fp8_gemv.py.

    python -m tools.sweep_fp8_gemv [--shapes qkv,o,gate_up,down] [--batches 1] [--group 128] [--quick] [--plain]

Settings: the default tiles in each loop form (plain, prefetch, stages 2 and 3: kernels_src/gemv_loop.py) first,
then (without --quick) ROWS 1, 2, 4 x (BLOCK_K, warps) x the forms; --plain: the plain loop alone (the other forms
lost at every shape on the H200, 2026-12-03: a quarter of the builds). Each setting is checked against fp8_gemv_ref on
sampled rows before it is timed; times are CUDA-graph replays (tools/bench_kernels.time_calls) cycling over enough
weight copies that W never sits in L2, bf16 x, W random finite e4m3 codes with f32 scales per group.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

from tools.bench_int_group_gemm import L2_BYTES, SHAPES

TARGET = "triton"  # (a CPU test runs the sweep's check on the DSL interpreter)
FORMS = ((False, 0), (True, 0), (False, 2), (False, 3))  # (prefetch, stages)
SPACE = ((512, 1), (1024, 1), (1024, 2), (2048, 2), (2048, 4), (4096, 4))  # (BLOCK_K, warps): 1-2 vectors a lane
GAIN = 0.97  # a setting enters the printed table when it takes at most this fraction of the default's time


def settings(k: int, m: int, quick: bool, forms=FORMS) -> list[dict]:
    """fp8_gemv keywords to time, the default tiles (plain) first, then in the other forms, then the space."""
    from kernels_src.fp8_gemv import default_tiles

    t = default_tiles(k, m)
    tiles = [dict(rows=t["ROWS"], block_k=t["BLOCK_K"], num_warps=t["num_warps"])]
    if not quick:
        tiles += [dict(rows=r, block_k=b, num_warps=w) for r, (b, w) in itertools.product((1, 2, 4), SPACE)
                  if b <= max(16, k) and dict(rows=r, block_k=b, num_warps=w) != tiles[0]]
    return [s | dict(prefetch=pf, stages=st) for s in tiles for pf, st in forms]


def check(torch, d, x, codes, scales, s: dict) -> str | None:
    """None, or what is off in fp8_gemv's output at setting s on sampled rows."""
    from kernels_src.fp8_gemv import fp8_gemv, fp8_gemv_ref
    from tools.kernel_case_base import compare, host

    y = torch.full((x.shape[0], codes.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    fp8_gemv(x, codes, scales, out=y, target=TARGET, **s)
    i = d.sample(codes.shape[0])
    return compare("y", host(y[:, i]), fp8_gemv_ref(host(x), host(codes[i]), host(scales[i])), "bfloat16")[1]


def weight_copies(d, n: int, k: int, group: int) -> list:
    """Enough copies of random e4m3 W [n, k] with f32 group scales (2-8) that three times the L2 lies between two
    reads of one."""
    from tools.kernel_cases_fp8 import fp8_weights

    w_bytes = n * k * (1 + 4 / group)
    return [fp8_weights(d, n, k, group) for _ in range(max(2, min(8, -(-3 * L2_BYTES // int(w_bytes)))))]


def shape_names(ap, a) -> list[str]:
    """--shapes' names, each of SHAPES (ap.error otherwise)."""
    names = [s.strip() for s in a.shapes.split(",") if s.strip()]
    if not names or any(s not in SHAPES for s in names):
        ap.error(f"--shapes {a.shapes}: of {', '.join(SHAPES)}")
    return names


def print_tuned(table: dict, where: str, others: str) -> None:
    """The TUNED literal of a sweep's winners, for `where`; problems not listed take `others`."""
    print(f"\n# the best where it beats the default by {100 * (1 - GAIN):.0f}% or more: for {where} (those not "
          f"listed take {others})\nTUNED = {{")
    for key, tiles in table.items():
        print(f"    {key!r}: {tiles},")
    print("}")


def sweep(torch, shapes: dict, batches, group: int, quick: bool, forms=FORMS) -> dict:
    """Time every setting of each (shape, M); print rows as they come and return the TUNED entries."""
    from kernels_src import e4m3
    from kernels_src.fp8_gemv import fp8_gemv
    from tools.bench_kernels import copy_gbps, time_calls
    from tools.kernel_case_base import Dev

    copy = copy_gbps(torch, 2**30)
    cvt = "the cvt" if e4m3.use_cvt(TARGET) else "integer ops (LLM_ENGINE_FP8_CVT=0, or a GPU without e4m3)"
    print(f"copy {copy:.0f} GB/s; {torch.cuda.get_device_name()}; e4m3 decoded by {cvt}", flush=True)
    print(f"{'shape':8} {'N x K':>12} {'M':>2} {'rows':>4} {'block_k':>7} {'warps':>5} {'pf':>2} {'st':>2} {'us':>8} "
          f"{'GB/s':>6} {'%copy':>5}  check", flush=True)
    table = {}
    for name, (n, k) in shapes.items():
        d = Dev(n * 7 + k)
        w_bytes = n * k * (1 + 4 / group)
        ws = weight_copies(d, n, k, group)
        for m in batches:
            x = d.randn((m, k), torch.bfloat16)
            y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            us = {}
            for s in settings(k, m, quick, forms):
                problem = check(torch, d, x, *ws[0], s)
                if problem:
                    print(f"{name:8} WRONG {s}: {problem}", flush=True)
                    continue

                def run(s=s, x=x, y=y, ws=ws):
                    for codes, scales in ws:
                        fp8_gemv(x, codes, scales, out=y, target=TARGET, **s)
                key = tuple(s.values())
                us[key] = t = time_calls(torch, run, len(ws), contextlib.nullcontext, False)[0]
                print(f"{name:8} {f'{n}x{k}':>12} {m:2} {s['rows']:4} {s['block_k']:7} {s['num_warps']:5} "
                      f"{s['prefetch']:2d} {s['stages']:2d} {t:8.1f} {w_bytes / t / 1e3:6.0f} "
                      f"{100 * w_bytes / t / 1e3 / copy:5.0f}  PASS", flush=True)
            if not us:
                continue
            default = tuple(settings(k, m, True)[0].values())
            best = min(us, key=us.get)
            print(f"{name:8} {f'{n}x{k}':>12} {m:2} best {dict(zip(settings(k, m, True)[0], best, strict=True))}: "
                  f"{us[best]:.1f} us against {us.get(default, float('nan')):.1f} at the default", flush=True)
            if default in us and us[best] <= GAIN * us[default]:
                rows, block_k, warps, pf, st = best
                table[(group, m, n, k)] = dict(ROWS=rows, BLOCK_K=block_k, num_warps=warps, prefetch=pf, stages=st)
        del ws
        torch.cuda.empty_cache()
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.sweep_fp8_gemv", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}, comma-separated")
    ap.add_argument("--batches", default="1", help="rows M, comma-separated, 1-8")
    ap.add_argument("--group", type=int, default=128, help="inputs a scale (a multiple of 16 dividing K)")
    ap.add_argument("--quick", action="store_true", help="the default tiles in each loop form only")
    ap.add_argument("--plain", action="store_true", help="the plain loop only (no prefetch, no stages)")
    a = ap.parse_args(argv)
    names = shape_names(ap, a)
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    if not batches or any(not 1 <= m <= 8 for m in batches):
        ap.error(f"--batches {a.batches}: rows from 1 to 8")
    if a.group < 16 or a.group % 16 or any(SHAPES[s][1] % a.group for s in names):
        ap.error(f"--group {a.group}: a multiple of 16 dividing every K")
    import torch

    table = sweep(torch, {s: SHAPES[s] for s in names}, batches, a.group, a.quick, FORMS[:1] if a.plain else FORMS)
    print_tuned(table, "fp8_gemv.TUNED", "default_tiles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
