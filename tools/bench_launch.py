"""Host cost of launching kernels and of an eager decode step on the CUDA backend (issue 13: eager within 1.5x of
CUDA graphs). Three figures, each in microseconds of host time:

- one DSL kernel launch (a one-row rms_norm, far shorter on the GPU than its launch) through the C launcher of its
  compiled kernel (`dsl.launch.DIRECT_LAUNCH`), through Triton's `JITFunction.run`, and a tiny `F.linear` and
  `torch.empty` for scale; and a kept launch (a BoundLaunch called again, as an eager step's memo does: the
  one-row GEMV's, 7 array arguments) with its arrays passed as addresses or as tensors (`dsl.launch.INT_POINTERS`);
- an eager decode step of a synthetic Llama-3-8B-shaped model (`--layers`) at `--batch` (1), both launch paths,
  beside the same engine's CUDA-graph step (the peer: the issue's target is eager within 1.5x of it);
- a Python profile of the eager steps (the 25 largest by own time), for where the rest goes;
- a step that prefills one prompt of 16 / 128 / 512 tokens, replayed in pieces (backends.cuda.piecewise) against
  the same step run eagerly.

    python -m tools.bench_launch [--layers 8] [--steps 32] [--batch 1] [--no-prefill] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import numpy as np
import torch

from kernels_src import rms_norm
from kernels_src.dsl import launch as dsl_launch


def per_call_us(fn, n: int = 2000) -> float:
    """Host microseconds per call of `fn` when the GPU keeps up (each launch is shorter on the GPU than its host
    cost), synchronized at both ends."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def launch_costs() -> dict[str, float]:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    small_w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    small_x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    res = {}
    for direct in (True, False):
        dsl_launch.DIRECT_LAUNCH = direct
        name = "DSL launch, C launcher" if direct else "DSL launch, Triton's JITFunction.run"
        res[name] = per_call_us(lambda: rms_norm.rms_norm(x, w, 1e-5, out=out, target="triton"))
    dsl_launch.DIRECT_LAUNCH = True
    from kernels_src.dense_gemv import launched

    wg = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty((1, 64), device="cuda", dtype=torch.bfloat16)
    launched(x, wg, out=y, target="triton")  # plans it
    _, (again, args) = launched(x, wg, out=y, target="triton")
    given = dsl_launch.INT_POINTERS  # LLM_ENGINE_INT_POINTERS's, for the steps after this
    for ints in (True, False):
        dsl_launch.INT_POINTERS = ints
        res[f"kept GEMV launch, arrays as {'addresses' if ints else 'tensors'}"] = per_call_us(lambda: again(*args))
    dsl_launch.INT_POINTERS = given
    res["torch.empty"] = per_call_us(lambda: torch.empty((1, 4096), device="cuda", dtype=torch.bfloat16))
    res["F.linear 1x64x64"] = per_call_us(lambda: torch.nn.functional.linear(small_x, small_w))
    return res


def step_ms(engine, steps: int, vocab: int, profile: bool = False, batch: int = 1) -> tuple[float, str]:
    """Mean ms of `steps` decode steps at `batch` (prefill and warm-up untimed), and their profile if asked."""
    from core.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, vocab, 128).tolist(),
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    if prof:
        prof.disable()
    ms = (time.perf_counter() - t) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    text = ""
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        text = s.getvalue()
    return ms, text


def prefill_steps(engine, vocab: int, sizes=(16, 128, 512), reps: int = 5) -> dict[str, float]:
    """ms of a step that prefills one prompt of n tokens, replayed in pieces (backends.cuda.piecewise) and eager."""
    from tools.bench_gpu_rates import prefill_seconds

    backend, pieces, out = engine.backend, engine.backend.pieces, {}
    rng = np.random.default_rng(1)
    for n in sizes:
        for mode in ("pieces", "eager"):
            backend.pieces = pieces if mode == "pieces" else None
            times = [prefill_seconds(engine, n, vocab, rng) * 1e3 for _ in range(reps + 1)]
            out[f"prefill {n}, {mode}"] = float(np.median(times[1:]))  # the first may compile
            print(f"{out[f'prefill {n}, {mode}']:8.2f} ms  prefill step of {n} tokens, {mode}", flush=True)
    backend.pieces = pieces
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="sequences a decode step")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill steps in pieces")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_launch.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch needs a CUDA GPU")
    from tools.bench_gpu import engine_for
    from tools.bench_gpu_model import dense_params, loaded_model, model_config

    res: dict = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "batch": args.batch,
                 "launch_us": launch_costs()}
    for name, us in res["launch_us"].items():
        print(f"{us:8.1f} us  {name}", flush=True)
    cfg = model_config(args.layers)
    model = loaded_model(cfg)
    params = dense_params(model.graph)
    res["step_ms"] = {}
    for graphs in (True, False):
        engine = engine_for(model, params, args.batch, 256, graphs=graphs)
        modes = (True,) if graphs else (True, False)
        for direct in modes:
            dsl_launch.DIRECT_LAUNCH = direct
            name = "CUDA graphs" if graphs else f"eager, {'C launcher' if direct else 'JITFunction.run'}"
            res["step_ms"][name], _ = step_ms(engine, args.steps, cfg.vocab_size, batch=args.batch)
            print(f"{res['step_ms'][name]:8.2f} ms a step  {name} ({args.layers} layers, batch {args.batch})",
                  flush=True)
        if not graphs:
            dsl_launch.DIRECT_LAUNCH = True
            _, res["profile"] = step_ms(engine, args.steps, cfg.vocab_size, profile=True, batch=args.batch)
            print(res["profile"], flush=True)
        elif not args.no_prefill:
            res["prefill_ms"] = prefill_steps(engine, cfg.vocab_size)
        del engine
    g = res["step_ms"]["CUDA graphs"]
    for name, ms in res["step_ms"].items():
        print(f"| {name} | {ms:.2f} ms | {ms / g:.2f}x graphs |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
