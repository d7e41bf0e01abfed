"""Decode steps replayed as CUDA graphs: one per (batch-size bucket, split-K partitions bucket).

A decode step of an 8B model launches some 300 kernels; replaying them as one graph removes the host's launch
cost, which at batch 1 would otherwise exceed the GPU time. Inputs live in static device buffers: a step copies its
batch in (padding rows: token 0, slot -1 so nothing is written, context 0 so nothing is read), replays, and reads
the static logits. The decode kernel's grid depends on the longest context, so graphs are also keyed by the number
of partitions, rounded up to a power of two; all share one memory pool.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from backends.cuda.runner import DECODE_PARTITION, Runner, StepMeta, partitions_for
from backends.cuda.runtime import torch
from ir.batch import Batch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: launch costs matter little there


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, runner: Runner, max_blocks_per_seq: int, max_context: int, max_batch: int = 256):
        self.runner = runner
        max_batch = min(max_batch, MAX_GRAPH_BATCH)
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_parts = _pow2(partitions_for(max_context))
        dev = runner.device
        b, m = self.buckets[-1], max(1, max_blocks_per_seq)

        def pinned(shape, dtype):
            t = torch.zeros(shape, dtype=dtype, pin_memory=True)
            return t, t.numpy()

        self._host = {k: pinned(s, d) for k, (s, d) in {
            "tokens": ((b,), torch.int32), "positions": ((b,), torch.int32), "slots": ((b,), torch.int64),
            "tables": ((b, m), torch.int32), "ctx": ((b,), torch.int32)}.items()}
        self._dev = {k: torch.zeros_like(t, device=dev) for k, (t, _) in self._host.items()}
        self._qstart = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self._rows = torch.arange(b, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def applies(self, batch: Batch) -> bool:
        return (batch.is_decode and batch.num_tokens <= self.buckets[-1]
                and batch.block_tables.shape[1] <= self._host["tables"][1].shape[1])

    def _key(self, n: int, max_context: int) -> tuple[int, int]:
        bucket = next(b for b in self.buckets if b >= n)
        return bucket, min(_pow2(partitions_for(max_context)), self.max_parts)

    def capture_all(self) -> None:
        """The common graphs up front (contexts up to one partition), largest first so smaller ones reuse memory."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            self._capture((b, 1))
        log.info("captured %d CUDA graphs (decode batches %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    def _meta(self, b: int, parts: int) -> StepMeta:
        d = self._dev
        return StepMeta(d["positions"][:b], d["slots"][:b], d["tables"][:b], d["ctx"][:b], self._qstart[:b + 1],
                        decode=True, max_query_len=1, max_context=parts * DECODE_PARTITION)

    def _capture(self, key: tuple[int, int]) -> None:
        b, parts = key
        meta = self._meta(b, parts)
        self._dev["slots"][:b].fill_(-1)
        self._dev["ctx"][:b].zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up compiles the kernels; capture must not
            self.runner.run(self._dev["tokens"][:b], self._rows[:b], meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.runner.run(self._dev["tokens"][:b], self._rows[:b], meta)
        self.graphs[key] = (graph, logits)

    def __call__(self, batch: Batch) -> torch.Tensor:
        n = batch.num_tokens
        key = self._key(n, int(batch.context_lens.max()))
        b = key[0]
        h = {k: a for k, (_, a) in self._host.items()}
        h["tokens"][:n], h["tokens"][n:b] = batch.token_ids, 0
        h["positions"][:n], h["positions"][n:b] = batch.positions, 0
        h["slots"][:n], h["slots"][n:b] = batch.slot_mapping, -1
        h["ctx"][:n], h["ctx"][n:b] = batch.context_lens, 0
        w = batch.block_tables.shape[1]
        h["tables"][:n, :w] = np.maximum(batch.block_tables, 0)
        h["tables"][n:b] = 0
        for k, (t, _) in self._host.items():
            self._dev[k][:b].copy_(t[:b], non_blocking=True)
        if key not in self.graphs:
            log.info("capturing a CUDA graph for decode batch %d, %d partitions", *key)
            self._capture(key)
            return self(batch)
        graph, logits = self.graphs[key]
        graph.replay()
        out = logits[:n]
        if len(batch.logits_indices) != n or np.any(batch.logits_indices != np.arange(n)):
            out = out[torch.from_numpy(batch.logits_indices.astype(np.int64)).to(out.device)]
        return out
