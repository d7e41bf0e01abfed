"""Rank 0 of an MLX tensor-parallel run, in a process of its own (MLX joins one ring a process): greedy tokens and
the first step's logits of tiny prompts, saved for test_mlx_tensor_parallel to compare with one process.

python -m tests.mlx_tp_driver MODEL_DIR WORLD OUT.npz [NEW]"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

from backends.mlx import tensor_parallel
from ir.loader import load_model
from ir.reference import ReferenceRunner
from tools.tiny_hf import backend_greedy

BLOCK = 4


def run(model_dir: str, world: int, prompts: list[list[int]], new: int, then_kill: bool = False) -> dict:
    """Tokens per prompt and the first step's logits of `world` ranks, rank 0 here; with then_kill, rank 1 is
    then killed and the error of the next run (and whether the engine would stop for it) kept too."""
    model = load_model(model_dir, progress=False)
    backend = tensor_parallel.start(model, world, dtype="f32", progress=False)
    ref = ReferenceRunner(model, max_tokens=48, block_size=BLOCK)
    out = {"kv_heads": backend.kv_layout().shapes[0].heads}
    try:
        tokens, out["first"] = backend_greedy(backend, ref, prompts, new, BLOCK)
        out["tokens"] = np.array(tokens)
        if then_kill:
            worker = backend.workers.procs[1]
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            try:
                backend_greedy(backend, ref, prompts, new, BLOCK)
            except Exception as e:  # noqa: BLE001  (reported to the test)
                out["error"], out["fatal"] = f"{type(e).__name__}: {e}", backend.is_fatal(e)
    finally:
        backend.workers.close()
    return out


if __name__ == "__main__":
    folder, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    spec = json.loads(sys.argv[4])
    np.savez(out, **run(folder, world, spec["prompts"], spec["new"], spec.get("then_kill", False)))
