"""The engine's own Python per decode step (scheduler, batch building, sampling bookkeeping, reports), with a stub
backend whose forward costs nothing: the host time a GPU step waits for. On an H200 a batch-64 decode step of an 8B
model takes ~6.8 ms, so every 0.1 ms here is ~1.5% of throughput.

    python -m tools.bench_engine_host [--batch 64] [--gen 128] [--repeats 5] [--profile]
    (pin it for stable figures: taskset -c 1 python -m tools.bench_engine_host)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from backends.base import Backend, MemoryReport
from frontend.engine.engine import EngineConfig, LLMEngine
from frontend.engine.sampling_params import SamplingParams
from frontend.engine.scheduler import SchedulerConfig
from ir.config import ModelConfig
from ir.rope import RopeSpec

VOCAB = 1000


class StubBackend(Backend):
    """Zero logits, instantly: greedy sampling picks token 0 every step."""

    name = "stub"

    def __init__(self):
        cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope=RopeSpec(1e4, 64),
                          max_position_embeddings=8192)
        self.model = type("StubModel", (), {"config": cfg, "tokenizer": None})()
        self.logits = np.zeros((1024, VOCAB), np.float32)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 1

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        return None

    def forward(self, batch):
        return self.logits[: len(batch.logits_indices)]

    def memory(self) -> MemoryReport:
        return MemoryReport(0, 0, "none")


def run(batch: int, gen: int, prompt: int, prefix_caching: bool, profile: bool) -> float:
    """Milliseconds of engine Python per decode step."""
    engine = LLMEngine(StubBackend(), EngineConfig(
        num_kv_blocks=batch * (-(-(prompt + gen) // 16) + 1) + 16, prefix_caching=prefix_caching,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt,
                                  prefill_chunk_size=prompt)))
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, VOCAB, prompt).tolist(),
                           SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    engine.step()  # the prefills
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return dt / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one run instead (slower: not a figure)")
    args = ap.parse_args()
    if args.profile:
        run(args.batch, args.gen, args.prompt, not args.no_prefix_cache, True)
        return
    times = [run(args.batch, args.gen, args.prompt, not args.no_prefix_cache, False) for _ in range(args.repeats)]
    print(f"engine Python per decode step at batch {args.batch}: best {min(times):.3f} ms, median "
          f"{sorted(times)[len(times) // 2]:.3f} ms ({args.repeats} runs of {args.gen - 1} steps)")


if __name__ == "__main__":
    main()
