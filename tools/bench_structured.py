"""Decode throughput with structured outputs: a batch decoding free text vs the same batch held to a JSON schema by
token masks, and the ratio. Usage: python -m tools.bench_structured [--model PATH] [--backend mlx] [--batch 16]

The schema (a long array of small objects) cannot be complete within --gen tokens, so both runs decode the whole
batch for the same number of steps: the difference is the masks' cost (matchers advanced, masks filled, applied).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}


def decode_rate(engine, prompts: list[list[int]], params) -> float:
    """Generated tokens a second over the decode steps (prefill untimed)."""
    for p in prompts:
        engine.add_request(p, params)
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    t, n = time.perf_counter(), engine.stats["generation_tokens"]
    while engine.has_unfinished():
        engine.step()
    return (engine.stats["generation_tokens"] - n) / (time.perf_counter() - t)


def main() -> None:
    from backends.base import create_backend
    from core.sampling_params import SamplingParams, StructuredOutput
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig
    from ir.default_model import default_model_path
    from ir.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file or HF folder (default: SmolLM2)")
    p.add_argument("--backend", default="mlx")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gen", type=int, default=64, help="tokens decoded per sequence")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs of each, interleaved")
    p.add_argument("--profile", action="store_true", help="then one more run of each under cProfile: the host's "
                   "milliseconds a step in the engine's parts (masks, sampling, read-back, forward's launch)")
    args = p.parse_args()
    model = load_model(args.model or default_model_path(), progress=False)
    backend = create_backend(args.backend, model, progress=False)
    engine = LLMEngine(backend, EngineConfig(num_kv_blocks=args.batch * (args.gen + 64) // 16 + 64,
                                             prefix_caching=False,
                                             scheduler=SchedulerConfig(max_num_seqs=args.batch)))
    tok = model.tokenizer
    asks = [f"List {i + 5} people as JSON." for i in range(args.batch)]  # a synthetic GGUF has no chat template
    prompts = [tok.apply_chat_template([{"role": "user", "content": a}]) if tok.chat_template else tok.encode(a)
               for a in asks]
    free = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True,
                          structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    decode_rate(engine, prompts, free)  # warm-up: compiled steps, the library's tokenizer
    decode_rate(engine, prompts, held)
    best = {"free": 0.0, "json_schema": 0.0}
    for _ in range(args.repeats):
        best["free"] = max(best["free"], decode_rate(engine, prompts, free))
        best["json_schema"] = max(best["json_schema"], decode_rate(engine, prompts, held))
    print(f"{Path(str(args.model or default_model_path())).name} on {backend.name}, {platform.machine()}, "
          f"{os.cpu_count()} cores; batch {args.batch}, {args.gen} tokens each, best of {args.repeats}")
    print(f"unconstrained {best['free']:.1f} tok/s, JSON schema {best['json_schema']:.1f} tok/s, "
          f"ratio {best['json_schema'] / best['free']:.3f}")
    if args.profile:
        for name, params in (("free", free), ("json_schema", held)):
            host_profile(name, lambda params=params: decode_rate(engine, prompts, params), args.gen)


PARTS = {"step": "engine.py:step", "launch": "engine.py:_launch", "forward": "forward", "sample": "engine.py:_sample",
         "masks": "token_masks.py:fill", "sampler": "sample_async", "read-back": "engine.py:_resolve",
         "matchers": "token_masks.py:advance", "report": "engine.py:_report"}


def host_profile(name: str, run, steps: int) -> None:
    """Host milliseconds a decode step spent in each of PARTS (cumulative, cProfile's clock) during one run."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    cells = []
    for label, part in PARTS.items():  # a function's name, or file:name where the name is common
        ct = sum(v[3] for (f, _, fn), v in stats.items() if part in (fn, f"{Path(f).name}:{fn}"))
        cells.append(f"{label} {1e3 * ct / steps:.2f}")
    print(f"host ms a step, {name}: wall {1e3 * wall / steps:.2f} (profiled), " + ", ".join(cells))


if __name__ == "__main__":
    main()
