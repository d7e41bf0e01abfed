"""Host cost of an eager decode step on the CUDA backend, measured on CPU (issue 13: eager within 1.5x of CUDA
graphs). The backend's Runner runs a small Llama-shaped synthetic model on CPU tensors as if on a GPU (target
"triton", the dense GEMV on), with every DSL kernel launch a no-op *in this tool only*: what is left is the Python
and torch host work of a step (the decisions, the wrappers, the allocations, the launch path down to the C
launcher's call), which on a GPU the kernels wait for. Prints the median and 10th percentile ms of `backend.forward`
per step and per layer, and a cProfile of the steps (the --top largest by own time).

    python -m tools.bench_eager_host [--layers 8] [--batch 1] [--context 128] [--steps 200] [--top 25]
    (pin it for stable figures: taskset -c 1 python -m tools.bench_eager_host)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from kernels_src.dsl import launch as dsl_launch

SMALL = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=128, vocab_size=512)
BLOCK = 16


def no_op_launches() -> None:
    """Kernels are never built: a first launch 'compiles' to a stub, every later one takes the direct path (direct_key,
    the cache of launchers) down to a C launcher that does nothing. The torch GEMMs (cuBLAS on a GPU: the linears
    of more rows than the GEMV takes) only allocate their output: on CPU their arithmetic would swamp the host
    cost at batch 16."""
    dsl_launch.Kernel._build = lambda self, *args, signature=None: lambda grid, *a: True
    dsl_launch.direct_launcher = lambda compiled: lambda grid, args: True
    dsl_launch.DIRECT_LAUNCH = True
    torch.nn.functional.linear = lambda x, w, b=None: x.new_empty((*x.shape[:-1], w.shape[0]))


def backend_for(layers: int, max_batch: int, context: int):
    from backends.cuda.backend import CUDABackend
    from tools.bench_gpu_model import loaded_model, model_config

    cfg = model_config(layers).with_(**SMALL)
    backend = CUDABackend(loaded_model(cfg), dtype="bf16", device="cpu", cuda_graph=False, random_weights=0,
                          progress=False)
    runner = backend.runner
    runner.target, runner.dense_gemv, runner.dense_gemm = "triton", True, True  # as on a GPU
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


if __name__ == "__main__":
    main()
