"""Whether the CUDA backend's start-up warm-ups leave a kernel variant for a serving step to compile, on a MoE (issue
16: the warm-up keys a MoE's token counts on its slot count, kernels_src/moe.py slot_bounds / slot_key). A synthetic
model of a checkpoint's shape (its config.json in tests/data/hf_configs, DeepSeek-V2-Lite's by default; a few
layers, random weights; --quant q4km: Q4_K_M-like blocks, where every K is whole super-blocks, so not DeepSeek's
1,408), built and warmed up as the server builds it (graphs on or off), then one prompt of every token count
1..--max-tokens (nothing written: slots -1). Each launch's variant is recorded as tests/test_cuda_eager_warmup.py
records it (the kernel, its constexprs, warps / PDL / stages, Triton's specialization of the arguments): one first
launched after the warm-ups is one a serving step compiled. Prints those (the step's tokens, the kernel) and the
slowest steps; JSON to $OUT/check_moe_warmup.json.

    python -m tools.check_moe_warmup [--shape deepseek-v2-lite] [--layers 2] [--graphs] [--max-tokens 2048]
                                     [--seqs 64] [--quant q4km]
On CPU tensors (--device cpu, a tiny --hidden for Triton's interpreter) the tool runs the eager warm-ups itself (a
CPU backend's allocate_kv warms nothing up): a smoke run of the tool, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

BLOCK = 16


class Recorder:
    """Kernel.launch recording each launch's variant and the step that launched it first (None: the start-up)."""

    def __init__(self):
        from kernels_src.dsl import launch
        from kernels_src.dsl.triton_target import variant_key

        self.first: dict[tuple, object] = {}
        self.step = None
        real = launch.Kernel.launch

        def spy(kernel, grid, args):
            self.first.setdefault(variant_key(kernel, args), self.step)
            return real(kernel, grid, args)

        launch.Kernel.launch = spy

    def after_start_up(self) -> list[tuple[object, tuple]]:
        return [(step, key) for key, step in self.first.items() if step is not None]


def build(args):
    from backends.base import create_backend
    from ir.models import for_hf
    from tools.bench_gpu_model import CONFIGS, loaded_model, quant_params

    hf = json.loads((CONFIGS / f"{args.shape}.json").read_text())
    cfg = for_hf(hf["model_type"]).config_from_hf(hf).with_(num_layers=args.layers)
    if args.hidden:  # a smoke run's model: every width cut down
        cfg = cfg.with_(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        moe_intermediate_size=args.hidden, vocab_size=512)
    model = loaded_model(cfg)
    weights = {"params": quant_params(args.quant, model.graph, args.layers)} if args.quant else {"random_weights": 0}
    backend = create_backend("cuda", model, dtype="bf16", device=args.device, cuda_graph=args.graphs,
                             progress=False, **weights)
    backend.set_limits(args.seqs, args.context, args.max_tokens)
    return backend, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v2-lite", help="a config.json in tests/data/hf_configs: "
                    "deepseek-v2-lite, qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2, help="DeepSeek-V2-Lite's first layer is dense: 2 has a MoE")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (steps past the pieces are eager)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="max step tokens (the server's default 2,048)")
    ap.add_argument("--seqs", type=int, default=64, help="max sequences (the server's default 64)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--quant", choices=("q4km", "int4", "fp8"), help="tools/bench_gpu_model.quant_params")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=0, help="cut every width to this (a CPU smoke run)")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "check_moe_warmup.json")
    args = ap.parse_args()

    import torch

    from backends.cuda.warm_batches import one_sequence, warm_up_eager_decode, warm_up_eager_prefill

    backend, cfg = build(args)
    rec = Recorder()
    t0 = time.perf_counter()
    backend.allocate_kv(args.seqs * (-(-args.context // BLOCK) + 1) + 1, BLOCK)  # the start-up's warm-ups
    if backend.device.type != "cuda":
        warm_up_eager_decode(backend, args.context)
        warm_up_eager_prefill(backend, args.context)
    start_up = time.perf_counter() - t0
    groups, times = backend.kv_layout().num_groups, {}
    for n in range(1, args.max_tokens + 1):
        rec.step = n
        width = -(-n // BLOCK)
        batch = one_sequence(np.zeros(n, np.int32), np.arange(n, dtype=np.int32) % args.context,
                             np.full(n, -1, np.int32), np.zeros((1, width), np.int32), groups)
        t = time.perf_counter()
        backend.forward(batch)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        times[n] = time.perf_counter() - t
    missed = rec.after_start_up()
    slow = sorted(times, key=times.get, reverse=True)[:10]
    experts, top_k = getattr(cfg, "num_experts", 0), getattr(cfg, "top_k", 1)
    graphs = "on" if args.graphs else "off"
    print(f"{args.shape} ({experts} experts, top {top_k}), {args.layers} layers, graphs {graphs}"
          f"{', ' + args.quant if args.quant else ''}: start-up {start_up:.1f} s, {len(rec.first)} variants before "
          f"the sweep; {len(missed)} first launched by a step of 1..{args.max_tokens} tokens")
    for step, key in missed:
        print(f"  {step} tokens: {key[0]} {dict(key[1])} {key[3]}")
    print("slowest steps (tokens: ms):", ", ".join(f"{n}: {times[n] * 1e3:.1f}" for n in slow))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(
        shape=args.shape, layers=args.layers, graphs=args.graphs, quant=args.quant, max_tokens=args.max_tokens,
        seqs=args.seqs, start_up_s=start_up, variants=len(rec.first),
        missed=[dict(tokens=s, kernel=k[0], constexprs=repr(k[1]), args=repr(k[3])) for s, k in missed],
        slowest_ms={n: times[n] * 1e3 for n in slow}), indent=1))


if __name__ == "__main__":
    main()
