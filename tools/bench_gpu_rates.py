"""What tools/bench_gpu and tools/bench_gguf measure on a GPU: the ceilings (copy bandwidth, bf16 GEMM rate) and an
engine's decode and prefill rates, its kernels' time by name, and the flops and bytes the rates are held against."""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from ir.config import ModelConfig

GB = 1e9


# --- ceilings --------------------------------------------------------------------------------------------------

def _time_cuda(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy of 2 GiB (bytes read + written)."""
    a = torch.empty(2**30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    t = _time_cuda(lambda: b.copy_(a), 10)
    return 2 * a.numel() * a.element_size() / t / GB


def gemm_rate() -> float:
    """TFLOP/s of a bf16 8192^3 matmul."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = _time_cuda(lambda: a @ b, 10)
    return 2 * n**3 / t / 1e12


def start_batch(engine, batch: int, prompt: int, max_tokens: int, vocab: int, seed: int) -> list[str]:
    """Add `batch` random prompts and step until every sequence has its first token (a long prompt takes several
    prefill steps, and the sequences prefilled first decode meanwhile); returns the request ids. Says so when some
    sequences finished in that time: the steps timed after it then run fewer rows than `batch` (16 prompts of 32k
    tokens take ~125 prefill steps of 4,096 tokens, so max_tokens of 32 left 1-row steps to time, session 19)."""
    from core.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(rng.integers(0, vocab, prompt).tolist(), params) for _ in range(batch)]
    steps = 0
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
        steps += 1
    running = len(engine.scheduler.running)
    if running < batch:
        print(f"  batch {batch}: {batch - running} of its sequences finished during the {steps} steps that gave every "
              f"one its first token: the timed steps run {running} rows, not {batch} (ask for more than {steps} new "
              f"tokens)", flush=True)
    return ids


def decode_rate(engine, batch: int, prompt: int, gen: int, vocab: int, seed: int = 0,
                show_steps: bool = False) -> float:
    """Generated tokens per second once every sequence has its first token (prefill untimed). show_steps: print every
    timed step's sequences and milliseconds (step_listing)."""
    start_batch(engine, batch, prompt, gen, vocab, seed)
    torch.cuda.synchronize()
    # Tokens of a step launched before the clock starts (overlapped steps: read back later) are not counted.
    before = engine.stats["generation_tokens"] + sum(s.pending for s in engine.scheduler.running)
    t = time.perf_counter()
    steps, rows = [], []
    with GcPauses() as gc_pauses:
        while engine.has_unfinished():
            rows.append(len(engine.scheduler.running))
            t_step = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t_step)
        torch.cuda.synchronize()
    if show_steps:
        print(f"  decode batch {batch}, every timed step (sequences:ms): {step_listing(rows, steps)}", flush=True)
    tokens, seconds = engine.stats["generation_tokens"] - before, time.perf_counter() - t
    if gc_pauses.seconds > 0.01 * seconds:
        print(f"  decode batch {batch}: garbage collections took {gc_pauses}", flush=True)
    if (slow := outlier_steps(steps)) is not None:
        print(f"  decode batch {batch}: {slow[0]} step(s) took {slow[1]:.2f} s of the timed {seconds:.2f} s "
              f"(median step {slow[2] * 1e3:.2f} ms): kernels compiled or a graph captured inside the timed steps; "
              f"without them {tokens / (seconds - slow[1] + slow[0] * slow[2]):,.0f} tok/s", flush=True)
    elif (spread := step_spread(steps)) is not None:
        print(f"  decode batch {batch}: steps {spread}", flush=True)
    return tokens / seconds


def step_listing(rows: list[int], seconds: list[float]) -> str:
    """Steps as "sequences:ms", runs of equal sequence counts shown once ("16:9.5 9.5 9.6 15:14.2"): where a rate's
    slow steps lie (session 18 found an eager batch's slow steps were those where it shrank)."""
    out, last = [], None
    for n, s in zip(rows, seconds, strict=True):
        out.append(f"{n}:{s * 1e3:.1f}" if n != last else f"{s * 1e3:.1f}")
        last = n
    return " ".join(out)


class GcPauses:
    """Python's garbage collections while active (gc.callbacks): how many of each generation and their seconds."""

    def __init__(self):
        self.counts, self.seconds, self._start = [0, 0, 0], 0.0, 0.0

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._note)

    def __str__(self) -> str:
        return f"{self.seconds * 1e3:.1f} ms ({'/'.join(map(str, self.counts))} of generations 0/1/2)"


def step_spread(seconds: list[float], factor: float = 1.15) -> str | None:
    """The timed steps' median, mean and slowest three (ms) when the mean is over `factor` x the median: a few slow
    steps (under outlier_steps' bar) or a slow start that the rate averages in; None when steps are steady."""
    if len(seconds) < 3:
        return None
    med, mean = float(np.median(seconds)), float(np.mean(seconds))
    if mean <= factor * med:
        return None
    top = ", ".join(f"{s * 1e3:.1f}" for s in sorted(seconds)[-3:][::-1])
    return f"median {med * 1e3:.2f} ms, mean {mean * 1e3:.2f} ms, slowest {top} ms (step {int(np.argmax(seconds))})"


def outlier_steps(seconds: list[float], factor: float = 20.0, floor: float = 0.05) -> tuple[int, float, float] | None:
    """(how many, their seconds, the median step) of the steps over `factor` x the median and `floor` seconds: a
    one-time cost (a compile on first use, a capture) inside a rate's timed steps; None when there is none. An
    eager step's host time is otherwise steady, so one such step is what separates a warm-up that missed a variant
    from a step that is slow throughout."""
    if len(seconds) < 3:
        return None
    med = float(np.median(seconds))
    slow = [s for s in seconds if s > max(factor * med, floor)]
    return (len(slow), sum(slow), med) if slow else None


def _profiled_steps(engine, batch: int, prompt: int, vocab: int, steps: int, seed: int, activity: str) -> tuple:
    """(the torch profiler's record, wall seconds) of `steps` decode steps of `batch` random prompts, recording
    `activity` ("CUDA": the kernels, "CPU": the host's calls): every prefill done first (a long prompt takes several
    steps) and one step more, so only decode steps are seen; the requests aborted after."""
    from torch.profiler import ProfilerActivity, profile

    # as many new tokens as the context allows, so that no sequence finishes while the others prefill; the requests
    # are aborted after the profiled steps, not decoded to their end
    ids = start_batch(engine, batch, prompt, max(1, engine.max_model_len - prompt), vocab, seed)
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished():  # steps launched before the aborts (overlapped steps) are read back
        engine.step()
    return prof, wall


def kernel_profile(engine, batch: int, prompt: int, vocab: int, steps: int = 8, top: int = 12) -> list[tuple]:
    """The GPU time of `steps` decode steps at `batch` by kernel (CUDA graph replays included): where the time goes.
    Returns [(kernel, share of GPU time, us per step)], largest first, plus ("(all kernels)", 1, us) first."""
    prof, _ = _profiled_steps(engine, batch, prompt, vocab, steps, 2, "CUDA")
    rows = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(t for _, t in rows) or 1
    rows.sort(key=lambda r: -r[1])
    return [("(all kernels)", 1.0, total / steps)] + [(k[:60], t / total, t / steps) for k, t in rows[:top]]


def host_profile(engine, batch: int, prompt: int, vocab: int, steps: int = 8, top: int = 10) -> list[tuple]:
    """Where the host's time goes in `steps` decode steps at `batch`: the wall per step, then the CUDA runtime and
    driver calls by their own host time (a synchronize or a copy that waits on the stream shows as milliseconds
    here, a launch as microseconds). Returns [(name, calls per step, us per step)], ("(wall)", 1, us) first. The
    profiler's own cost is in the wall: compare it with an unprofiled step, not with the GPU's time."""
    prof, wall = _profiled_steps(engine, batch, prompt, vocab, steps, 3, "CPU")
    rows = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("cu")]
    rows.sort(key=lambda r: -r[2])
    return [("(wall)", 1.0, wall * 1e6 / steps)] + [(k[:60], c / steps, us / steps) for k, c, us in rows[:top]]


def prefill_seconds(engine, tokens: int, vocab: int, rng) -> float:
    """Wall seconds of one prompt of random `tokens` ids prefilled to its first token (synchronized both ends)."""
    from core.sampling_params import SamplingParams

    engine.add_request(rng.integers(0, vocab, tokens).tolist(), SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def prefill_rate(engine, tokens: int, vocab: int, reps: int = 3) -> float:
    rng = np.random.default_rng(1)
    return tokens / min(prefill_seconds(engine, tokens, vocab, rng) for _ in range(reps))


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 flops per weight per token for every matrix but the embedding (the head runs for one row), plus the
    causal attention's two products."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * f
    attn = 4 * cfg.num_heads * d * tokens * (tokens + 1) / 2
    return cfg.num_layers * (2 * per_layer * tokens + attn) + 2 * cfg.vocab_size * h


def weight_bytes(params) -> int:
    from backends.cuda.weights import nbytes

    return sum(nbytes(p) for p in params.values())
