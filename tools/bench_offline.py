"""Offline throughput of the engine on the current backend: prefill tok/s, decode tok/s at batch 1
and batch N, with llama.cpp (llama-cpp-python on the same GGUF) measured in the same run when it is
installed. Usage: python -m tools.bench_offline [--model PATH] [--batch 16] [--gen 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
        "books were made, how ideas travelled and how people learned to read. ")


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    ids = tokenizer.encode(f"{salt}. " + TEXT * (n // 20 + 2))
    return ids[:n]


def bench_engine(args) -> dict[str, float]:
    from backends.base import create_backend
    from core.sampling_params import SamplingParams
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig
    from ir.loader import load_model

    model = load_model(args.model)
    backend = create_backend(args.backend, model)
    cfg = EngineConfig(num_kv_blocks=(args.batch + 1) * (args.prompt_len + args.gen + 64) // 16 + 64,
                       prefix_caching=False,
                       scheduler=SchedulerConfig(max_num_seqs=max(args.batch, 1),
                                                 max_num_batched_tokens=max(args.prefill_len, 2048),
                                                 prefill_chunk_size=max(args.prefill_len, 512)))
    engine = LLMEngine(backend, cfg)
    tok = model.tokenizer
    out = {"backend": f"{backend.name} ({getattr(backend, 'describe', lambda: '')()})"}

    def decode(batch: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=args.gen + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request(prompt_ids(tok, args.prompt_len, i), params)
        while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefills, untimed
        t, n = time.perf_counter(), 0
        with tqdm(total=args.gen * batch, desc=f"decode batch {batch}", unit="tok", leave=False) as bar:
            while engine.has_unfinished():
                before = engine.stats["generation_tokens"]
                engine.step()
                bar.update(engine.stats["generation_tokens"] - before)
                n += engine.stats["generation_tokens"] - before
        return n / (time.perf_counter() - t)

    # Warm-up: first calls pay for allocation and any lazy initialisation.
    engine.add_request(prompt_ids(tok, 64), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    times = []
    for r in tqdm(range(args.repeats), desc=f"prefill {args.prefill_len}", leave=False):
        engine.add_request(prompt_ids(tok, args.prefill_len, 100 + r), SamplingParams(max_tokens=1))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    out["prefill"] = args.prefill_len / min(times)
    out["decode_1"] = max(decode(1) for _ in range(args.repeats))
    out[f"decode_{args.batch}"] = decode(args.batch)
    assert engine.all_blocks_free()
    return out


def bench_llama_cpp(args) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(args.model), n_ctx=max(2048, args.prefill_len + 64), n_batch=512,
                n_threads=args.threads, verbose=False)
    tokenize = lambda n, salt: llm.tokenize((f"{salt}. " + TEXT * (n // 20 + 2)).encode(), add_bos=False)[:n]
    times = []
    for r in range(args.repeats):
        llm.reset()
        ids = tokenize(args.prefill_len, 100 + r)
        t = time.perf_counter()
        llm.eval(ids)
        times.append(time.perf_counter() - t)
    best = 0.0
    for _ in range(args.repeats):
        llm.reset()
        llm.eval(tokenize(args.prompt_len, 0))
        t = time.perf_counter()
        for _ in tqdm(range(args.gen), desc="llama.cpp decode", leave=False):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([nxt])
        best = max(best, args.gen / (time.perf_counter() - t))
    return {"backend": f"llama.cpp {getattr(__import__('llama_cpp'), '__version__', '')} ({args.threads} threads)",
            "prefill": args.prefill_len / min(times), "decode_1": best}


def main() -> None:
    from ir.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file or HF folder (default: SmolLM2 Q4_1)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length for the decode runs")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--gen", type=int, default=64, help="tokens decoded per sequence")
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs (prefill, batch-1 decode)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for the llama.cpp peer")
    p.add_argument("--no-peer", action="store_true")
    args = p.parse_args()
    args.model = args.model or default_model_path()
    rows = [bench_engine(args)]
    peer = None if args.no_peer else bench_llama_cpp(args)
    if peer:
        rows.append(peer)
    cols = ["prefill", "decode_1", f"decode_{args.batch}"]
    print(f"\n{args.model.name} on {platform.machine()} {platform.system()}, {os.cpu_count()} cores; "
          f"prefill {args.prefill_len} tokens, decode {args.gen} tokens after a {args.prompt_len}-token prompt")
    head = f"{'engine':<44}" + "".join(f"{c.replace('_', ' batch ') + ' tok/s':>22}" for c in cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['backend']:<44}" + "".join(f"{r[c]:>22.1f}" if c in r else f"{'n/a':>22}" for c in cols))
    if not peer and not args.no_peer:
        print("(no peer: pip install llama-cpp-python to measure llama.cpp in the same run)")


if __name__ == "__main__":
    main()
