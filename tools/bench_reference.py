#!/usr/bin/env python3
"""How fast the IR's numpy reference interpreter runs a model, beside transformers (fp32, eager) on
the same file: `python -m tools.bench_reference [PATH] [--new 32] [--threads 2]`.

The interpreter is the semantic reference, not a backend; this figure tells how long the reference
tests take, and is the baseline the backends are measured from.
"""

from __future__ import annotations

import argparse
import time

from ir.default_model import default_model_path
from ir.loader import load_model
from ir.reference import ReferenceRunner

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", help="a .gguf file (default: SmolLM2)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens to generate")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    args = ap.parse_args(argv)
    path = default_model_path() if args.path is None else args.path
    model = load_model(path)
    ids = model.tokenizer.apply_chat_template(PROMPT)
    eos = [model.tokenizer.eos_id]
    runner = ReferenceRunner(model, len(ids) + args.new + 1)
    runner.greedy([ids], 1)  # weights are dequantized once, on first use
    t = time.perf_counter()
    ours, _ = runner.greedy([ids], args.new, suppress=eos)
    rows = [("numpy interpreter (fp32)", time.perf_counter() - t)]

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    p = model.path
    hf = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        hf.generate(x, max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                          suppress_tokens=eos, eos_token_id=None, pad_token_id=0)
        rows.append((f"transformers eager fp32, {args.threads} threads", time.perf_counter() - t))
    same = out[0, len(ids):].tolist() == ours[0]
    print(f"\n{p.name}: {len(ids)}-token prompt + {args.new} greedy tokens (tokens identical: {same})")
    print(f"{'runner':40s} {'seconds':>8s} {'tok/s':>7s}")
    for name, s in rows:
        print(f"{name:40s} {s:8.2f} {args.new / s:7.1f}")


if __name__ == "__main__":
    main()
