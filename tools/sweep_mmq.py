#!/usr/bin/env python3
"""The int8 tensor-core GEMM (kernels_src/gguf_mmq.py, each variant) against the fp16 dequantizing GEMM
(dequant_gemm.py, its tuned tiles) on a CUDA GPU: `python -m tools.sweep_mmq [--budget S] [--ms 16,32,64]
[--variants per32,per32p,per256]`.

Q4_K (or --qtype Q6_K) at the Llama-3-8B shapes (N x K: fused gate/up, gate/up, down, fused qkv, o, and the head),
bf16 x. Each mmq setting (variant, block_n, num_warps, num_stages or the K loop's own stages, split_k around
mmq_tiles' rule) is checked once against mmq_ref (the variant's x quantization) on sampled columns, then timed with
CUDA graphs (the x pre-pass included: it is part of every call). Ends with a table (us of each variant's best, % of
copy bandwidth, the speed-up over dequant_gemm) and `MMQ_TUNED = {...}` for kernels_src/gguf_mmq.py, the best setting
of any variant (its `variant` named)."""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from tools.bench_kernels import copy_gbps
from tools.sweep_gemm import _setup, _time

SHAPES = ((28672, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (128256, 4096))
TOL = 2e-2  # of the largest output: bf16 x and y


def _check(torch, mmq, mmq_ref, x, w, cfg, qtype) -> float:
    y = mmq(x, w, qtype, target="triton", **cfg)
    cols = torch.randperm(w.shape[0], device="cuda")[:48].cpu().numpy()
    want = mmq_ref(x.float().cpu().numpy(), w[cols].cpu().numpy(), qtype, cfg["variant"])
    got = y[:, cols].float().cpu().numpy().astype(np.float64)
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return np.inf  # a NaN anywhere is wrong (and would compare as not > TOL)
    return float(np.abs(got - want).max() / np.abs(want).max())


# (num_stages, loop_stages): the compile's stages (Triton pipelines the loads that feed a dot: x's) with the plain K
# loop, or the K loop itself pipelined (gguf_mmq.LOOP_STAGES: W's loads by cp.async too)
STAGES = ((2, 0), (3, 0), (4, 0), (3, 2), (3, 3))


def _settings(rule: dict, variants: list[str], m: int):
    """Each variant's settings: block_n 64 / 128, 4 / 8 warps (8 with block_n 64 only for per256 at 64 rows, where
    two warpgroups share the rows and 4 warps spill), STAGES, split_k around the rule's."""
    for var, bn, nw, (ns, ls), sf in itertools.product(variants, (64, 128), (4, 8), STAGES, (0.5, 1, 2)):
        if nw == 4 or bn == 128 or (var == "per256" and m > 32):
            yield dict(variant=var, block_n=bn, num_warps=nw, num_stages=ns, loop_stages=ls,
                       split_k=max(1, int(rule["SPLIT"] * sf)))


def _problem(torch, weights, dequant_matmul, mmq, mmq_ref, rule: dict, m: int, n: int, k: int, qtype: str,
             variants: list[str]):
    """(dequant_gemm us (dequant_gemv's at <= 8 rows), {variant: (us at its rule, best us, best settings)}, bytes
    moved) of one problem."""
    from kernels_src.dequant_gemv import dequant_gemv

    w = weights(qtype, n, k)
    x = torch.randn((m, k), device="cuda").bfloat16()
    y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    ref = dequant_gemv if m <= 8 else dequant_matmul
    base = _time(torch, lambda: ref(x, w, qtype, out=y, target="triton"))
    best: dict = {}
    for cfg in _settings(rule, variants, m):
        try:
            err = _check(torch, mmq, mmq_ref, x, w, cfg, qtype)
        except Exception as e:  # noqa: BLE001 - a setting that does not build is skipped, said once
            print(f"  m={m} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if not err <= TOL:
            print(f"  m={m} {n}x{k} {cfg}: WRONG (rel err {err:.3g})")
            continue
        t = _time(torch, lambda cfg=cfg: mmq(x, w, qtype, out=y, target="triton", **cfg))
        if t < best.get(cfg["variant"], (np.inf,))[0]:
            best[cfg["variant"]] = (t, cfg)
    if not best:
        return None
    res = {v: (_time(torch, lambda v=v: mmq(x, w, qtype, out=y, target="triton", variant=v)), t, cfg)
           for v, (t, cfg) in best.items()}
    return base, res, w.numel() + 2 * x.numel() + 2 * y.numel()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=240, help="seconds for the whole sweep")
    ap.add_argument("--qtype", default="Q4_K", choices=("Q4_K", "Q6_K"))
    ap.add_argument("--ms", default="16,32,64", help="rows (at 8 or fewer the peer is dequant_gemv)")
    ap.add_argument("--shapes", default=None, help="N x K problems, e.g. 14336x4096,4096x14336 (default: all)")
    ap.add_argument("--variants", default="per32,per32p,per256", help="mmq variants to compare (gguf_mmq.VARIANTS)")
    args = ap.parse_args(argv)
    from kernels_src.gguf_mmq import VARIANTS, mmq, mmq_ref, mmq_tiles

    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        raise SystemExit(f"sweep_mmq: --variants takes {', '.join(VARIANTS)}, got {args.variants!r}")
    torch, weights = _setup()
    from kernels_src.dequant_gemm import dequant_matmul

    t0 = time.monotonic()
    gbps = copy_gbps(torch, 2**30)
    print(f"copy {gbps:.0f} GB/s")
    rows, tuned = [], {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(map(int, v.split("x"))) for v in args.shapes.split(",")] if args.shapes else SHAPES
    for m, (n, k) in itertools.product([int(v) for v in args.ms.split(",")], shapes):
        if time.monotonic() - t0 > args.budget:
            print("budget spent: stopping")
            break
        row = _problem(torch, weights, dequant_matmul, mmq, mmq_ref, mmq_tiles(args.qtype, m, n, k, sms), m, n, k,
                       args.qtype, variants)
        if row is None:
            continue
        base, res, nbytes = row
        rows.append((m, n, k, base, res, nbytes))
        win = min(res.values(), key=lambda r: r[1])
        tuned[(args.qtype, 16 if m <= 16 else 32 if m <= 32 else 64, n, k)] = win[2]
        print(f"m={m:3d} {n:6d}x{k:5d}: dequant_gemm {base:7.1f} us | " + " | ".join(
            f"{v} rule {r[0]:7.1f} best {r[1]:7.1f} us {100 * nbytes / r[1] / 1e3 / gbps:5.1f}% of copy "
            f"{base / r[1]:4.2f}x" for v, r in res.items()) + f"  best {win[2]}", flush=True)
    print("\n| M | N x K | dequant_gemm us | " + " | ".join(f"{v} us (rule / best) | % of copy" for v in variants)
          + " | best / dequant_gemm |")
    print("|---|---|---:|" + "---:|---:|" * len(variants) + "---:|")
    for m, n, k, base, res, nb in rows:
        cells = [f"{res[v][0]:.1f} / {res[v][1]:.1f} | {100 * nb / res[v][1] / 1e3 / gbps:.1f}" if v in res
                 else "- | -" for v in variants]
        print(f"| {m} | {n}x{k} | {base:.1f} | " + " | ".join(cells)
              + f" | {base / min(r[1] for r in res.values()):.2f}x |")
    print("\nMMQ_TUNED = {")
    for key, cfg in tuned.items():
        print(f"    {key!r}: {cfg!r},")
    print("}")


if __name__ == "__main__":
    main()
