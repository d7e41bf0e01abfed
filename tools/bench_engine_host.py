"""The engine's own Python per decode step (scheduler, batch building, sampling bookkeeping, detokenizing, reports),
with a stub backend whose forward costs nothing: the host time a GPU step waits for. On an H200 a batch-64 decode
step of an 8B model takes ~6.8 ms, so every 0.1 ms here is ~1.5% of throughput.

    python -m tools.bench_engine_host [--batch 64] [--gen 128] [--repeats 5] [--text] [--penalties] [--window 50]
        [--profile]
    (pin it for stable figures: taskset -c 1 python -m tools.bench_engine_host)

With --text the stub carries the default model's tokenizer, so every token is detokenized as when serving; the
median step of the first and of the last --window steps shows whether a step's cost grows with the output's length.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import dataclass

import numpy as np

from backends.base import Backend, MemoryReport
from core.kv_layout import KVLayout
from core.sampling_params import SamplingParams
from frontend.engine.engine import EngineConfig, LLMEngine
from frontend.engine.scheduler import SchedulerConfig
from ir.config import ModelConfig
from ir.rope import RopeSpec

VOCAB = 1000


class StubBackend(Backend):
    """Logits ready at once: greedy sampling picks, for each row, the same token every step (0 without text; with a
    tokenizer, one of the vocabulary's plain word pieces, so that the text grows as a real output's does)."""

    name = "stub"

    def __init__(self, tokenizer=None, max_len: int = 8192):
        cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope=RopeSpec(1e4, 64),
                          max_position_embeddings=max_len)
        self.model = type("StubModel", (), {"config": cfg, "tokenizer": tokenizer, "pooling": None})()
        self.logits = np.zeros((1024, VOCAB), np.float32)
        if tokenizer is not None:
            words = [i for i in range(300, VOCAB) if tokenizer.decode([i]).strip().isalpha()]
            self.logits[np.arange(1024), np.resize(words, 1024)] = 1.0

    def kv_layout(self) -> KVLayout:
        return KVLayout.from_layers([None], [(1, 64, 64)])  # one layer, one group (the stub has no graph)

    def kv_bytes_per_block(self, block_size: int, group: int | None = None) -> int:
        return 1

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        return None

    def forward(self, batch):
        return self.logits[: len(batch.logits_indices)]

    def memory(self) -> MemoryReport:
        return MemoryReport(0, 0, "none")


@dataclass
class Run:
    mean_ms: float  # over every decode step
    first_ms: float  # median of the first `window` decode steps
    last_ms: float  # median of the last `window`


def run(batch: int, gen: int, prompt: int, prefix_caching: bool, profile: bool, tokenizer=None,
        window: int = 50, penalties: bool = False) -> Run:
    """Milliseconds of engine Python per decode step."""
    engine = LLMEngine(StubBackend(tokenizer, max(8192, prompt + gen)), EngineConfig(
        num_kv_blocks=batch * (-(-(prompt + gen) // 16) + 1) + 16, prefix_caching=prefix_caching,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt,
                                  prefill_chunk_size=prompt)))
    rng = np.random.default_rng(0)
    extra = dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1) if penalties else {}
    for _ in range(batch):
        engine.add_request(rng.integers(0, VOCAB, prompt).tolist(),
                           SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True, **extra))
    engine.step()  # the prefills
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    ms = np.array(steps) * 1e3
    return Run(float(ms.mean()), float(np.median(ms[:window])), float(np.median(ms[-window:])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--text", action="store_true", help="detokenize with the default model's tokenizer")
    ap.add_argument("--penalties", action="store_true", help="repetition, frequency and presence penalties (these "
                    "read each sequence's tokens so far)")
    ap.add_argument("--window", type=int, default=50, help="steps in the first and last medians")
    ap.add_argument("--profile", action="store_true", help="cProfile one run instead (slower: not a figure)")
    args = ap.parse_args()
    tokenizer = None
    if args.text:
        from ir.default_model import default_model_path
        from ir.loader import load_model

        tokenizer = load_model(default_model_path(), progress=False).tokenizer
    go = lambda profile: run(args.batch, args.gen, args.prompt, not args.no_prefix_cache, profile, tokenizer,
                             args.window, args.penalties)
    if args.profile:
        go(True)
        return
    runs = [go(False) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r.mean_ms)
    median = sorted(r.mean_ms for r in runs)[len(runs) // 2]
    w = min(args.window, args.gen - 1)
    what = (", detokenized" if tokenizer else "") + (", penalties" if args.penalties else "")
    print(f"engine Python per decode step at batch {args.batch}: best {best.mean_ms:.3f} ms, median {median:.3f} ms "
          f"({args.repeats} runs of {args.gen - 1} steps{what}); "
          f"median step, best run: {min(r.first_ms for r in runs):.3f} ms over the first {w} tokens, "
          f"{min(r.last_ms for r in runs):.3f} ms over the last {w} (to {args.gen})")


if __name__ == "__main__":
    main()
