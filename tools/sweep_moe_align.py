#!/usr/bin/env python3
"""Time moe_align alone on a CUDA GPU: `python -m tools.sweep_moe_align [--tokens 64,128] [--layers 16]`.

Qwen3-30B-A3B's routing (128 experts, top 8), random ids, `layers` routings grouped back to back in one CUDA graph
(do_bench_cudagraph; a grouped step groups once a layer): the one-launch kernel (kernels_src/moe_align.py) against
the torch array ops it replaces (kernels_src/moe.py's `_align`), at each batch and BLOCK_M (16, and 64 where the
launcher's rule or moe_mmq would take it), after checking the two agree exactly. us a layer and the saving."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tools.sweep_moe import E, K  # Qwen3-30B-A3B's experts and top_k


def time_align(torch, tokens: int, block_m: int, layers: int, experts: int = E, top_k: int = K) -> dict:
    import triton.testing

    from kernels_src import moe

    gen = torch.Generator("cuda").manual_seed(tokens)
    ids = [torch.rand((tokens, experts), device="cuda", generator=gen).argsort(-1)[:, :top_k].to(torch.int32)
           for _ in range(layers)]
    for i in ids:  # the kernel's outputs against the array ops', bit for bit
        for a, b in zip(moe.moe_align(i, experts, block_m, "triton"), moe.moe_align(i, experts, block_m), strict=True):
            assert torch.equal(a, b), f"moe_align's kernel differs from its array ops at {tokens} tokens"

    def run(target):
        return lambda: [moe.moe_align(i, experts, block_m, target) for i in ids]

    us = {name: triton.testing.do_bench_cudagraph(run(target), rep=50, return_mode="median") * 1e3 / layers
          for name, target in (("kernel", "triton"), ("torch", None))}
    return dict(tokens=tokens, slots=tokens * top_k, block_m=block_m, kernel_us=us["kernel"], torch_us=us["torch"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,64,128", help="batches (at most 128: the kernel's 1,024 slots)")
    ap.add_argument("--layers", type=int, default=16, help="routings grouped in one graph replay")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "sweep_moe_align.json")
    args = ap.parse_args(argv)
    import torch

    rows = []
    print(f"{'tokens':>6} {'slots':>5} {'BLOCK_M':>7} {'kernel us':>9} {'torch us':>8} {'saved us':>8}", flush=True)
    for t in (int(v) for v in args.tokens.split(",")):
        for block_m in (16, 64):
            r = time_align(torch, t, block_m, args.layers)
            rows.append(r)
            print(f"{t:6d} {r['slots']:5d} {block_m:7d} {r['kernel_us']:9.2f} {r['torch_us']:8.2f} "
                  f"{r['torch_us'] - r['kernel_us']:8.2f}", flush=True)
    args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
