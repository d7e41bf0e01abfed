"""Decode steps replayed as CUDA graphs: one per (batch-size bucket, split-K partitions bucket).

A decode step of an 8B model launches some 300 kernels; replaying them as one graph removes the host's launch
cost, which at batch 1 would otherwise exceed the GPU time. Inputs live in static device buffers: a step copies its
batch in (padding rows: token 0, slot -1 so nothing is written, context 0 so nothing is read; each KV group of
core.kv_layout has slot and table buffers of its own), replays, and reads the static logits. The decode kernel's
grid depends on the longest context, so graphs are also keyed by the number of split-K partitions, a power of two
up to `Runner.max_partitions` of the batch: the kernel lengthens the partitions of a longer context, so the largest
key serves every context up to max_model_len, and every key is captured at start-up (a few per batch bucket). All
share one memory pool. A capture never reads the live step's inputs (it runs on padding rows of its own), and one
that fails leaves that key to eager steps, logged once.

Input tokens are gathered on the device from one buffer: its head (`chain`) holds the tokens the last step
sampled, its tail the tokens copied from the host, so a step launched before the last one's tokens reached the
host reads them where they are (Batch.prev_rows). Host staging buffers alternate between two sets: the engine
writes the next step's inputs while the copies of the one before may still be queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from backends.cuda.decode_table import pow2
from backends.cuda.runner import Runner
from backends.cuda.runtime import torch
from backends.cuda.step_meta import StepMeta, partitions_for
from core.batch import Batch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: launch costs matter little there


def try_capture(failed: dict, key, capture: Callable[[Any], None], what: str) -> bool:
    """capture(key), unless it failed before; a failure is kept in `failed` and logged once, `what` saying which
    steps the key (a value or a tuple of them) names and how they run instead (a format for the key)."""
    if key in failed:
        return False
    try:
        capture(key)
        return True
    except Exception as e:  # noqa: BLE001  (any capture error: those steps still run another way)
        failed[key] = f"{type(e).__name__}: {e}"
        log.warning("CUDA graph capture for %s failed: %s", what % key, failed[key])
        return False


def warm_and_capture(step: Callable[[], torch.Tensor | None], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """`step` run once on a side stream (it compiles the kernels, which a capture must not), then captured into a
    new graph in `pool`: (the graph, what the captured call returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class GraphKeys:
    """Which graph serves a decode step: (rows rounded up to a batch bucket, split-K partitions). Plain Python over
    the runner's partition rules, so that CI checks on a CPU that every step finds a captured key."""

    def __init__(self, runner: Runner, max_batch: int, max_context: int):
        self.runner, self.max_context = runner, max_context
        max_batch = min(max_batch, MAX_GRAPH_BATCH)
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]

    def parts(self, bucket: int, context: int) -> int:
        """Split-K partitions of a graph for `bucket` rows: for the context, rounded up to a power of two, within
        what the longest context needs and the batch's cap (past it partitions grow instead)."""
        part = self.runner.decode_partition(bucket)
        return min(pow2(partitions_for(context, part)), pow2(partitions_for(self.max_context, part)),
                   self.runner.max_partitions(bucket))

    def key(self, n: int, context: int) -> tuple[int, int]:
        bucket = next(b for b in self.buckets if b >= n)
        return bucket, self.parts(bucket, context)

    def all(self) -> list[tuple[int, int]]:
        """Every key a decode step up to max_context can ask for, largest first."""
        return [(b, 1 << i) for b in reversed(self.buckets)
                for i in reversed(range(self.parts(b, self.max_context).bit_length()))]


class DecodeGraphs:
    def __init__(self, runner: Runner, max_blocks_per_seq: int, max_context: int, max_batch: int = 256,
                 chain_size: int = 256):
        self.runner = runner
        self.keys = GraphKeys(runner, max_batch, max_context)
        self.buckets = self.keys.buckets
        dev = runner.device
        b, m = self.buckets[-1], max(1, max_blocks_per_seq)

        def pinned(shape, dtype):
            t = torch.zeros(shape, dtype=dtype, pin_memory=True)
            return t, t.numpy()

        shapes = {"tokens": ((b,), torch.int32), "src": ((b,), torch.int32), "positions": ((b,), torch.int32),
                  "slots": ((b,), torch.int64), "tables": ((b, m), torch.int32), "ctx": ((b,), torch.int32)}
        self.num_groups = 1 + max(runner.group_of, default=0)  # KV groups (core.kv_layout): slots, tables each
        for g in range(1, self.num_groups):
            shapes |= {f"slots{g}": ((b,), torch.int64), f"tables{g}": ((b, m), torch.int32)}
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
        self.failed: dict[tuple[int, int], str] = {}  # keys whose capture failed: their steps run eagerly
        self.pool = torch.cuda.graph_pool_handle()
        runner.decode_counters(b * runner.kv_heads)  # before any capture (Runner.decode_counters)

    def applies(self, batch: Batch) -> bool:
        width = self._host[0]["tables"][1].shape[1]
        return (batch.is_decode and batch.num_tokens <= self.buckets[-1]
                and all(batch.kv_group(g)[1].shape[1] <= width for g in range(self.num_groups)))

    @staticmethod
    def _keys(group: int) -> tuple[str, str]:
        """The buffers of a KV group's slots and block tables."""
        return ("slots", "tables") if group == 0 else (f"slots{group}", f"tables{group}")

    def capture_all(self) -> None:
        """Every graph up front, largest first so that smaller ones reuse the pool's memory."""
        t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved(self.runner.device)
        for key in self.keys.all():
            self._try_capture(key)
        log.info("captured %d CUDA graphs (decode batches %s, contexts up to %d) in %.1f s, %.0f MiB", len(self.graphs),
                 ",".join(map(str, self.buckets)), self.keys.max_context, time.perf_counter() - t0,
                 (torch.cuda.memory_reserved(self.runner.device) - mem0) / 2**20)

    def _meta(self, b: int, parts: int) -> StepMeta:
        d = self._dev
        groups = tuple((d[f"slots{g}"][:b], d[f"tables{g}"][:b]) for g in range(1, self.num_groups))
        return StepMeta(d["positions"][:b], d["slots"][:b], d["tables"][:b], d["ctx"][:b], self._qstart[:b + 1],
                        decode=True, max_query_len=1, max_context=parts * self.runner.decode_partition(b),
                        groups=groups)

    def _step(self, b: int, meta: StepMeta) -> torch.Tensor:
        tokens = self.token_buf.index_select(0, self._dev["src"][:b])
        return self.runner.run(tokens, self._rows[:b], meta)

    def _try_capture(self, key: tuple[int, int]) -> bool:
        """Captures `key`'s graph; a failure is logged (once per key) and leaves the key to eager steps."""
        return try_capture(self.failed, key, self._capture, "decode batch %d, %d partitions (those steps run eagerly)")

    def _capture(self, key: tuple[int, int]) -> None:
        """Warms up and captures on padding inputs of its own (host token 0, slot -1, context 0): the live step's
        buffers may hold placeholders (-1 for a token still on the device), which the gather must never read."""
        b, parts = key
        meta = self._meta(b, parts)
        self._dev["tokens"][:b].zero_()
        self._dev["src"][:b].copy_(torch.from_numpy(self._own[:b]), non_blocking=False)
        self._dev["positions"][:b].zero_()
        self._dev["ctx"][:b].zero_()
        for g in range(self.num_groups):
            slots, tables = self._keys(g)
            self._dev[slots][:b].fill_(-1)
            self._dev[tables][:b].zero_()
        self.graphs[key] = warm_and_capture(lambda: self._step(b, meta), self.pool)

    def __call__(self, batch: Batch) -> torch.Tensor | None:
        """The step's logits from its graph, or None when that graph could not be captured (run it eagerly)."""
        n = batch.num_tokens
        key = self.keys.key(n, int(batch.context_lens.max()))
        if key not in self.graphs:  # before this step's inputs are copied in: the capture overwrites them
            log.info("capturing a CUDA graph for decode batch %d, %d partitions", *key)
            if not self._try_capture(key):
                return None
        b = key[0]
        host = self._host[self._turn]
        self._copied[self._turn].synchronize()  # its last copies are done (long since, in practice)
        h = {k: a for k, (_, a) in host.items()}
        h["tokens"][:n], h["tokens"][n:b] = np.maximum(batch.token_ids, 0), 0  # a placeholder is never gathered
        h["src"][:b] = self._own[:b]
        if batch.prev_rows is not None:
            chained = batch.prev_rows >= 0
            h["src"][:n][chained] = batch.prev_rows[chained]
        h["positions"][:n], h["positions"][n:b] = batch.positions, 0
        h["ctx"][:n], h["ctx"][n:b] = batch.context_lens, 0
        for g in range(self.num_groups):
            (slots, tables), (sk, tk) = batch.kv_group(g), self._keys(g)
            h[sk][:n], h[sk][n:b] = slots, -1
            h[tk][:n, :tables.shape[1]] = np.maximum(tables, 0)
            h[tk][n:b] = 0
        for k, (t, _) in host.items():
            self._dev[k][:b].copy_(t[:b], non_blocking=True)
        self._copied[self._turn].record()
        self._turn ^= 1
        graph, logits = self.graphs[key]
        graph.replay()
        out = logits[:n]
        if len(batch.logits_indices) != n or np.any(batch.logits_indices != np.arange(n)):
            out = out[torch.from_numpy(batch.logits_indices.astype(np.int64)).to(out.device)]
        return out
