"""Time the FP8 GEMM (kernels_src/fp8_gemm.py, x's quantization included) over tiles on a CUDA GPU for Llama-3-8B's
projections at decode batches and prefill, against the path it replaces (W dequantized to bf16, then cuBLAS) and
bf16 cuBLAS on the same shapes; print the best per problem as a TUNED literal for fp8_gemm.

    python -m tools.sweep_fp8_gemm [--shapes qkv,o,gate_up,down] [--ms 16,64,2048] [--group 128] [--quick]

Settings: the default tiles first, then (without --quick) BLOCK_M x BLOCK_N x SWAP x warps x stages x split-K
(SPACE). Each is checked against the float64 product of the codes and scales that quantize_x gives on sampled rows
before it is timed; times are CUDA-graph replays (tools/bench_kernels.time_calls) over enough weight copies that W
never sits in L2 at decode's rows; bf16 x, W random finite e4m3 codes with f32 scales per group.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

from tools.bench_int_group_gemm import SHAPES
from tools.sweep_fp8_gemv import GAIN, print_tuned, shape_names, weight_copies

TARGET = "triton"  # (a CPU test runs the sweep's check on the DSL interpreter)
KEYS = ("block_m", "block_n", "swap", "num_warps", "num_stages", "split_k")
SPACE = {  # rows bucket -> (block_m, block_n, swap, warps) to try, each at stages 3 and 4 and split-K 1, 2, 4
    16: [(16, 64, True, 4), (16, 128, True, 4), (16, 128, True, 8), (16, 64, False, 4)],
    32: [(32, 64, True, 4), (32, 128, True, 4), (32, 128, True, 8), (32, 64, False, 4)],
    64: [(64, 64, True, 4), (64, 128, True, 8), (64, 64, False, 4), (64, 128, False, 4), (64, 256, False, 8)],
    128: [(64, 128, False, 4), (64, 256, False, 8), (128, 64, False, 4), (128, 128, False, 8), (128, 256, False, 8)],
}


def settings(m: int, n: int, k: int, group: int, quick: bool) -> list[dict]:
    """fp8_matmul keywords to time: the default tiles first, then SPACE's."""
    from kernels_src import fp8_gemm as fg

    t = fg.default_tiles(m, n, k, group)
    first = dict(block_m=t["BLOCK_M"], block_n=t["BLOCK_N"], swap=t["SWAP"], num_warps=t["num_warps"],
                 num_stages=t["num_stages"], split_k=t["SPLIT"])
    if quick:
        return [first]
    space = [dict(block_m=bm, block_n=bn, swap=sw, num_warps=w, num_stages=st, split_k=sk)
             for (bm, bn, sw, w), st, sk in itertools.product(SPACE[fg.rows_bucket(m)], (3, 4), (1, 2, 4))]
    return [first] + [s for s in space if s != first]


def check(torch, d, x, codes, scales, s: dict) -> str | None:
    """None, or what is off in fp8_matmul's output at setting s on sampled rows."""
    import numpy as np

    from ir.formats import fp8_blocks
    from kernels_src import fp8_gemm as fg
    from tools.kernel_case_base import compare, host

    m, k = x.shape
    group = k // scales.shape[1]
    y = torch.full((m, codes.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    fg.fp8_matmul(x, codes, scales, out=y, target=TARGET, **s)
    xq, xs = (host(t) for t in fg.quantize_x(x, group, target=TARGET))
    i = d.sample(codes.shape[0])
    xv = (fp8_blocks.decode(xq).astype(np.float64).reshape(m, -1, group) * xs[..., None]).reshape(m, k)
    wv = fp8_blocks.decode(host(codes[i])).astype(np.float64).reshape(len(i), -1, group) * host(scales[i])[..., None]
    return compare("y", host(y[:, i]), xv @ wv.reshape(len(i), k).T, "bfloat16")[1]


def _baselines(torch, x, ws, group: int) -> tuple[float, float]:
    """(us) of the dequantized path (backends/cuda/fp8_linear.dequantize, then x @ W.T) and of bf16 cuBLAS."""
    from backends.cuda.fp8_linear import dequantize
    from tools.bench_kernels import time_calls

    dense = [dequantize(c, s, torch.bfloat16) for c, s in ws[:2]]

    def deq():
        for c, s in ws:
            x @ dequantize(c, s, torch.bfloat16).T

    def bf16():
        for w in dense:
            x @ w.T
    return (time_calls(torch, deq, len(ws), contextlib.nullcontext, False)[0],
            time_calls(torch, bf16, len(dense), contextlib.nullcontext, False)[0])


def sweep(torch, shapes: dict, ms, group: int, quick: bool) -> dict:
    """Time every setting of each (shape, M); print rows as they come and return the TUNED entries."""
    from kernels_src import fp8_gemm as fg
    from tools.bench_kernels import time_calls
    from tools.kernel_case_base import Dev

    print(f"{torch.cuda.get_device_name()}; us per call (x's quantization included), TFLOP/s", flush=True)
    table = {}
    for name, (n, k) in shapes.items():
        d = Dev(n * 7 + k)
        ws = weight_copies(d, n, k, group)
        for m in ms:
            x = d.randn((m, k), torch.bfloat16)
            y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            deq, bf16 = _baselines(torch, x, ws, group)
            tflops = 2 * m * n * k / 1e6
            print(f"{name:8} {f'{n}x{k}':>12} M {m:5}: dequantized + cuBLAS {deq:9.1f} us, bf16 cuBLAS {bf16:9.1f} us "
                  f"({tflops / bf16:5.0f} TFLOP/s)", flush=True)
            us = {}
            for s in settings(m, n, k, group, quick):
                try:
                    problem = check(torch, d, x, *ws[0], s)
                except Exception as e:  # noqa: BLE001 - a setting that does not build (shared memory) is skipped
                    problem = f"{type(e).__name__}: {str(e)[:120]}"
                if problem:
                    print(f"{name:8} WRONG {s}: {problem}", flush=True)
                    continue

                def run(s=s, x=x, y=y, ws=ws):
                    for codes, scales in ws:
                        fg.fp8_matmul(x, codes, scales, out=y, target=TARGET, **s)
                us[tuple(s.values())] = t = time_calls(torch, run, len(ws), contextlib.nullcontext, False)[0]
                print(f"{name:8} {f'{n}x{k}':>12} M {m:5} {s} {t:9.1f} us {tflops / t:5.0f} TFLOP/s, "
                      f"{bf16 / t:5.2f}x bf16, {deq / t:5.2f}x dequantized  PASS", flush=True)
            if not us:
                continue
            default = tuple(settings(m, n, k, group, True)[0].values())
            best = min(us, key=us.get)
            print(f"{name:8} {f'{n}x{k}':>12} M {m:5} best {dict(zip(KEYS, best, strict=True))}: {us[best]:.1f} us "
                  f"against {us.get(default, float('nan')):.1f} at the default; {bf16 / us[best]:.2f}x bf16",
                  flush=True)
            if default in us and us[best] <= GAIN * us[default]:
                table[(group, fg.rows_bucket(m), n, k)] = dict(zip(KEYS, best, strict=True))
        del ws
        torch.cuda.empty_cache()
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.sweep_fp8_gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}, comma-separated")
    ap.add_argument("--ms", default="16,64,2048", help="rows M, comma-separated, 9 and up")
    ap.add_argument("--group", type=int, default=128, help="inputs a scale (a multiple of 32 dividing K)")
    ap.add_argument("--quick", action="store_true", help="the default tiles only (against the baselines)")
    a = ap.parse_args(argv)
    names = shape_names(ap, a)
    ms = [int(b) for b in a.ms.split(",") if b.strip()]
    if not ms or any(m < 9 for m in ms):
        ap.error(f"--ms {a.ms}: rows from 9 up (1-8 rows: tools/sweep_fp8_gemv)")
    if a.group < 32 or a.group % 32 or any(SHAPES[s][1] % a.group for s in names):
        ap.error(f"--group {a.group}: a multiple of 32 dividing every K")
    import torch

    table = sweep(torch, {s: SHAPES[s] for s in names}, ms, a.group, a.quick)
    print_tuned(table, "fp8_gemm.TUNED", "TILES and the split rule")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
