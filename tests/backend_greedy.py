"""Greedy decoding straight through a backend's forward, with the reference's (reversed) block tables: the loop
the backend tests share."""

from __future__ import annotations

import numpy as np

from core.batch import make_batch
from ir.reference import ReferenceRunner


def host(logits) -> np.ndarray:
    """fp32 numpy logits from a backend (numpy for MLX, a device tensor for CUDA)."""
    return logits.float().cpu().numpy() if hasattr(logits, "cpu") else np.array(logits, dtype=np.float32)


def backend_greedy(backend, ref: ReferenceRunner, prompts, n: int, block_size: int):
    """(tokens per prompt, first step's logits [len(prompts), vocab]) of n greedy steps of all prompts together."""
    tables = [ref._table(i) for i in range(len(prompts))]
    backend.allocate_kv(len(prompts) * ref.blocks_per_seq, block_size)
    chunks, cached, outs, first = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts], None
    for _ in range(n):
        logits = host(backend.forward(make_batch(chunks, cached, tables, block_size)))
        first = logits.copy() if first is None else first
        for i, t in enumerate(logits.argmax(-1)):
            outs[i].append(int(t))
            cached[i] += len(chunks[i])
            chunks[i] = [int(t)]
    return outs, first
