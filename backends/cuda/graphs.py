"""Decode steps replayed as CUDA graphs: one per (batch-size bucket, split-K partitions bucket).

A decode step of an 8B model launches some 300 kernels; replaying them as one graph removes the host's launch
cost, which at batch 1 would otherwise exceed the GPU time. Inputs live in static device buffers: a step copies its
batch in (padding rows: token 0, slot -1 so nothing is written, context 0 so nothing is read), replays, and reads
the static logits. The decode kernel's grid depends on the longest context, so graphs are also keyed by the number
of partitions, rounded up to a power of two; all share one memory pool.

Input tokens are gathered on the device from one buffer: its head (`chain`) holds the tokens the last step
sampled, its tail the tokens copied from the host, so a step launched before the last one's tokens reached the
host reads them where they are (Batch.prev_rows). Host staging buffers alternate between two sets: the engine
writes the next step's inputs while the copies of the one before may still be queued.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from backends.cuda.runner import Runner, StepMeta, partitions_for
from backends.cuda.runtime import torch
from ir.batch import Batch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: launch costs matter little there
CAPTURE_CONTEXT = 2048  # graphs for contexts up to this are captured at start-up, longer ones on first use


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, runner: Runner, max_blocks_per_seq: int, max_context: int, max_batch: int = 256,
                 chain_size: int = 256):
        self.runner = runner
        max_batch = min(max_batch, MAX_GRAPH_BATCH)
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_context = max_context
        dev = runner.device
        b, m = self.buckets[-1], max(1, max_blocks_per_seq)

        def pinned(shape, dtype):
            t = torch.zeros(shape, dtype=dtype, pin_memory=True)
            return t, t.numpy()

        shapes = {"tokens": ((b,), torch.int32), "src": ((b,), torch.int32), "positions": ((b,), torch.int32),
                  "slots": ((b,), torch.int64), "tables": ((b, m), torch.int32), "ctx": ((b,), torch.int32)}
        self._host = [{k: pinned(s, d) for k, (s, d) in shapes.items()} for _ in range(2)]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]  # per host set: recorded after its copies
        self._turn = 0
        self.chain_size = chain_size
        self.token_buf = torch.zeros(chain_size + b, dtype=torch.int32, device=dev)  # [chain | host tokens]
        self.chain = self.token_buf[:chain_size]
        self._dev = {k: torch.zeros(s, dtype=d, device=dev) for k, (s, d) in shapes.items() if k != "tokens"}
        self._dev["tokens"] = self.token_buf[chain_size:]
        self._own = np.arange(chain_size, chain_size + b, dtype=np.int32)  # src of tokens from the host
        self._qstart = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self._rows = torch.arange(b, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def applies(self, batch: Batch) -> bool:
        return (batch.is_decode and batch.num_tokens <= self.buckets[-1]
                and batch.block_tables.shape[1] <= self._host[0]["tables"][1].shape[1])

    def _parts(self, bucket: int, context: int) -> int:
        """Split-K partitions of a graph for `bucket` rows: for the context, rounded up to a power of two, within
        what the longest context needs."""
        part = self.runner.decode_partition(bucket)
        return min(_pow2(partitions_for(context, part)), _pow2(partitions_for(self.max_context, part)))

    def _key(self, n: int, max_context: int) -> tuple[int, int]:
        bucket = next(b for b in self.buckets if b >= n)
        return bucket, self._parts(bucket, max_context)

    def capture_all(self) -> None:
        """The graphs for contexts up to CAPTURE_CONTEXT up front, largest first so smaller ones reuse memory."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            top = self._parts(b, min(CAPTURE_CONTEXT, self.max_context))
            for parts in (1 << i for i in range(top.bit_length())):
                self._capture((b, parts))
        log.info("captured %d CUDA graphs (decode batches %s, contexts up to %d) in %.1f s", len(self.graphs),
                 ",".join(map(str, self.buckets)), min(CAPTURE_CONTEXT, self.max_context), time.perf_counter() - t0)

    def _meta(self, b: int, parts: int) -> StepMeta:
        d = self._dev
        return StepMeta(d["positions"][:b], d["slots"][:b], d["tables"][:b], d["ctx"][:b], self._qstart[:b + 1],
                        decode=True, max_query_len=1, max_context=parts * self.runner.decode_partition(b))

    def _step(self, b: int, meta: StepMeta) -> torch.Tensor:
        tokens = self.token_buf.index_select(0, self._dev["src"][:b])
        return self.runner.run(tokens, self._rows[:b], meta)

    def _capture(self, key: tuple[int, int]) -> None:
        b, parts = key
        meta = self._meta(b, parts)
        self._dev["slots"][:b].fill_(-1)
        self._dev["ctx"][:b].zero_()
        self._dev["src"][:b].fill_(self.chain_size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up compiles the kernels; capture must not
            self._step(b, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(b, meta)
        self.graphs[key] = (graph, logits)

    def __call__(self, batch: Batch) -> torch.Tensor:
        n = batch.num_tokens
        key = self._key(n, int(batch.context_lens.max()))
        b = key[0]
        host = self._host[self._turn]
        self._copied[self._turn].synchronize()  # its last copies are done (long since, in practice)
        h = {k: a for k, (_, a) in host.items()}
        h["tokens"][:n], h["tokens"][n:b] = batch.token_ids, 0
        h["src"][:b] = self._own[:b]
        if batch.prev_rows is not None:
            chained = batch.prev_rows >= 0
            h["src"][:n][chained] = batch.prev_rows[chained]
        h["positions"][:n], h["positions"][n:b] = batch.positions, 0
        h["slots"][:n], h["slots"][n:b] = batch.slot_mapping, -1
        h["ctx"][:n], h["ctx"][n:b] = batch.context_lens, 0
        w = batch.block_tables.shape[1]
        h["tables"][:n, :w] = np.maximum(batch.block_tables, 0)
        h["tables"][n:b] = 0
        for k, (t, _) in host.items():
            self._dev[k][:b].copy_(t[:b], non_blocking=True)
        self._copied[self._turn].record()
        self._turn ^= 1
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
