"""A mixed step (decode rows beside one new prompt) three ways on the CUDA backend: one whole CUDA graph
(backends.cuda.step_graphs), graphs in pieces around eager attention (backends.cuda.piecewise), and eager; beside
a decode step of the same rows (its decode graph), on the synthetic Llama-3-8B (random bf16 weights).

Each figure is ms a step, two ways: back to back (the host enqueues ahead, as the engine's overlapped steps do: the
larger of host and GPU time) and synchronized after each step (host launch plus GPU time). The whole graph's logits
are checked against the eager step's first (max |difference| over max |logit|).

    python -m tools.bench_mixed_step [--decodes 64] [--prompt 128] [--context 512] [--layers 32] [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

BLOCK = 16


def batches(decodes: int, prompt: int, context: int, vocab: int):
    """(mixed, decode-only) batches: `decodes` rows at `context` tokens each and one `prompt`-token prompt."""
    from core.batch import make_batch

    rng = np.random.default_rng(0)
    per = -(-(context + prompt + 1) // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(decodes + 1)]
    rows = [[int(t)] for t in rng.integers(0, vocab, decodes)]
    mixed = make_batch(rows + [rng.integers(0, vocab, prompt).tolist()], [context - 1] * decodes + [0], tables, BLOCK)
    decode = make_batch(rows, [context - 1] * decodes, tables[:decodes], BLOCK)
    return mixed, decode, (decodes + 1) * per


def time_steps(backend, batch, reps: int) -> tuple[float, float]:
    """(back-to-back ms, synchronized ms) a step."""
    for _ in range(3):
        backend.forward(batch)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        backend.forward(batch)
    torch.cuda.synchronize()
    ahead = (time.perf_counter() - t) / reps * 1e3
    synced = []
    for _ in range(reps):
        t = time.perf_counter()
        backend.forward(batch)
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - t)
    return ahead, float(np.median(synced)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--context", type=int, default=512, help="tokens each decode row has in the cache")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_mixed_step.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mixed_step needs a CUDA GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the graphs' capture lines
    from backends.cuda.backend import CUDABackend
    from tools.bench_gpu_model import dense_params, loaded_model, model_config

    cfg = model_config(args.layers)
    model = loaded_model(cfg)
    backend = CUDABackend(model, dtype="bf16", params=dense_params(model.graph), progress=False)
    backend.whole_steps = True
    mixed, decode, blocks = batches(args.decodes, args.prompt, args.context, cfg.vocab_size)
    backend.set_limits(args.decodes + 1, args.context + args.prompt + BLOCK, 512)
    t0 = time.perf_counter()
    backend.allocate_kv(blocks + 8, BLOCK)  # captures the decode graphs, the pieces and the whole-step graphs
    res: dict = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "decodes": args.decodes,
                 "prompt": args.prompt, "context": args.context, "start_up_s": time.perf_counter() - t0,
                 "whole_graphs": len(backend.whole.graphs), "whole_capture_s": backend.whole.capture_s,
                 "whole_capture_mib": backend.whole.capture_mib,
                 "whole_failed": {f"{t} tokens, {rows} rows": why for (t, rows), why in backend.whole.failed.items()}}
    print(f"start-up (KV cache and every graph) {res['start_up_s']:.1f} s; {res['whole_graphs']} whole-step graphs in "
          f"{res['whole_capture_s']:.1f} s, {res['whole_capture_mib']:.0f} MiB; failed: "
          f"{res['whole_failed'] or 'none'}", flush=True)
    whole, pieces = backend.whole, backend.pieces
    backend.whole = backend.pieces = None
    want = backend.forward(mixed).clone()
    backend.whole = whole
    got = backend.forward(mixed)
    res["whole_vs_eager"] = float((got - want).abs().max() / want.abs().max())
    print(f"whole graph against eager: max |diff| {res['whole_vs_eager']:.2e} of max |logit|", flush=True)
    res["ms"] = {}
    for name, w, p, batch in (("whole graph", whole, pieces, mixed), ("pieces", None, pieces, mixed),
                              ("eager", None, None, mixed), (f"decode {args.decodes} (decode graph)", None, None,
                                                             decode)):
        backend.whole, backend.pieces = w, p
        ahead, synced = time_steps(backend, batch, args.reps)
        res["ms"][name] = {"back_to_back": ahead, "synchronized": synced}
        print(f"{ahead:8.2f} ms back to back {synced:8.2f} ms synchronized  {name}", flush=True)
    backend.whole, backend.pieces = whole, pieces
    ms = res["ms"]
    print(f"| whole graph / pieces | {ms['whole graph']['back_to_back'] / ms['pieces']['back_to_back']:.2f}x back to "
          f"back | {ms['whole graph']['synchronized'] / ms['pieces']['synchronized']:.2f}x synchronized |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
