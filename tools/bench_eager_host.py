"""Host cost of an eager decode step on the CUDA backend, measured on CPU (issue 13: eager within 1.5x of CUDA
graphs). The backend's Runner runs a small Llama-shaped synthetic model on CPU tensors as if on a GPU (target
"triton", the dense GEMV on), with every DSL kernel launch a no-op *in this tool only*: what is left is the Python
and torch host work of a step (the decisions, the wrappers, the allocations, the launch path down to the C
launcher's call), which on a GPU the kernels wait for. Prints the median and 10th percentile ms of `backend.forward`
per step and per layer, the launches a step makes (DSL kernels by name, and the torch ops that launch a kernel on a
GPU, counted in steps of their own), and a cProfile of the steps (the --top largest by own time). The runner is set
as a backend built with graphs off sets it on a GPU (backends/cuda/eager.py; LLM_ENGINE_EAGER_FUSIONS=0: unfused).

    python -m tools.bench_eager_host [--layers 8] [--batch 1] [--context 128] [--steps 200] [--top 25]
    (pin it for stable figures: taskset -c 1 python -m tools.bench_eager_host)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import Counter

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.cuda import torch_ops
from kernels_src.dsl import launch as dsl_launch

SMALL = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=128, vocab_size=512)
BLOCK = 16


LAUNCHES: Counter = Counter()  # DSL kernel name -> launches through the direct path, while COUNTING
COUNTING = False


def no_op_launches() -> None:
    """Kernels are never built: a first launch 'compiles' to a stub, every later one takes the direct path (direct_key,
    the cache of launchers) down to a C launcher that does nothing (but count it, in the counted steps). The torch
    GEMMs (cuBLAS on a GPU: the linears of more rows than the GEMV takes) only allocate their output: on CPU their
    arithmetic would swamp the host cost at batch 16."""
    def stub(grid, args, name):
        if COUNTING:
            LAUNCHES[name] += 1
        return True

    dsl_launch.Kernel._build = lambda self, *args, signature=None: lambda grid, *a: self.fn.__name__
    dsl_launch.direct_launcher = lambda name: lambda grid, args: stub(grid, args, name)
    dsl_launch.DIRECT_LAUNCH = True
    torch.nn.functional.linear = lambda x, w, b=None: x.new_empty((*x.shape[:-1], w.shape[0]))
    # into a kept buffer (an eager step's, backends/cuda/step_arena.py): its torch.mm's arithmetic likewise skipped
    torch_ops.linear_into = lambda x, w, out=None: torch.nn.functional.linear(x, w) if out is None else out


class TorchLaunches(TorchDispatchMode):
    """Counts the torch ops of a step that launch a kernel on a GPU: all but views and allocations (and F.linear,
    stubbed to an allocation here: counted as a cuBLAS GEMM by the caller's wrapper)."""

    FREE = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "lift_fresh", "detach", "alias"}

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in self.FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_launches(backend, batch, steps: int = 10) -> tuple[Counter, Counter]:
    """(DSL launches by kernel, torch kernels by op) of one step, the mean of `steps` (counted, not timed)."""
    global COUNTING
    linear = torch.nn.functional.linear
    mode = TorchLaunches()

    into = torch_ops.linear_into

    def gemm(x, w, b=None):
        mode.ops["linear (cuBLAS)"] += 1
        return linear(x, w, b)

    def gemm_into(x, w, out=None):
        if out is None:
            return into(x, w)  # through gemm: counted there
        mode.ops["linear (cuBLAS)"] += 1
        return into(x, w, out)

    LAUNCHES.clear()
    torch.nn.functional.linear, torch_ops.linear_into, COUNTING = gemm, gemm_into, True
    try:
        with mode:
            for _ in range(steps):
                backend.forward(batch)
    finally:
        torch.nn.functional.linear, torch_ops.linear_into, COUNTING = linear, into, False
    per = lambda c: Counter({k: v // steps for k, v in c.items()})
    return per(LAUNCHES), per(mode.ops)


def backend_for(layers: int, max_batch: int, context: int):
    from backends.cuda import eager
    from backends.cuda.backend import CUDABackend
    from tools.bench_gpu_model import loaded_model, model_config

    cfg = model_config(layers).with_(**SMALL)
    backend = CUDABackend(loaded_model(cfg), dtype="bf16", device="cpu", cuda_graph=False, random_weights=0,
                          progress=False)
    runner = backend.runner
    runner.target, runner.dense_gemv, runner.dense_gemm = "triton", True, True  # as on a GPU
    if eager.DEFAULT:
        eager.use_eager_fusions(runner)  # as CUDABackend sets a GPU's with graphs off
    backend.set_limits(max_batch, context + 64)
    backend.allocate_kv(max_batch * (-(-(context + 64) // BLOCK)), BLOCK)
    return backend


def decode_batch(batch: int, context: int):
    """A decode step of `batch` sequences `context` tokens long, each in its own blocks."""
    from core.batch import Batch

    per = -(-context // BLOCK)
    tables = np.arange(batch * per, dtype=np.int32).reshape(batch, per)
    pos = np.full(batch, context - 1, np.int32)
    slots = tables[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
    return Batch(np.zeros(batch, np.int32), pos, slots.astype(np.int32), tables, np.full(batch, context, np.int32),
                 np.arange(batch + 1, dtype=np.int32), np.arange(batch, dtype=np.int32))


def time_steps(backend, batch, steps: int) -> np.ndarray:
    out = np.empty(steps)
    for i in range(steps):
        t = time.perf_counter()
        backend.forward(batch)
        out[i] = time.perf_counter() - t
    return out * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    no_op_launches()
    backend = backend_for(args.layers, args.batch, args.context)
    batch = decode_batch(args.batch, args.context)
    time_steps(backend, batch, 20)  # warm-up: first launches, caches
    dsl, ops = count_launches(backend, batch)
    ms = time_steps(backend, batch, args.steps)
    prof = cProfile.Profile()
    prof.enable()
    time_steps(backend, batch, args.steps)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())
    med, p10 = float(np.median(ms)), float(np.percentile(ms, 10))  # p10: what a busy machine's noise leaves least
    print(f"eager decode step, host only ({args.layers} layers, batch {args.batch}, context {args.context}): "
          f"median {med:.3f} ms, p10 {p10:.3f} ms; {med / args.layers * 1e3:.1f} us a layer (p10 "
          f"{p10 / args.layers * 1e3:.1f})")
    n_dsl, n_ops = sum(dsl.values()), sum(ops.values())
    print(f"launches a step: {n_dsl} DSL + {n_ops} torch = {n_dsl + n_ops}, {(n_dsl + n_ops) / args.layers:.2f} a "
          f"layer (DSL {n_dsl / args.layers:.2f})")
    print("  DSL: " + ", ".join(f"{k} {v}" for k, v in dsl.most_common()))
    print("  torch: " + ", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
