"""The multi-rank reference: every rank's graph (ir.sharding) on the numpy interpreter, one thread a rank, their
collectives met in memory. What it computes must be what one process computes, and what the backends' ranks do."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from core.batch import Batch
from ir.fusion import FusedWeights, fuse
from ir.graph import Node
from ir.interpreter import Collective, Interpreter, KVCache
from ir.loader import LoadedModel
from ir.reference import ReferenceRunner
from ir.sharding import ShardedWeights, shard


class Collectives:
    """all_reduce (summed in rank order) and all_gather among `world` threads, one a rank."""

    def __init__(self, world: int):
        self.world = world
        self._barrier = threading.Barrier(world, timeout=60)
        self._slots: list[np.ndarray | None] = [None] * world

    def abort(self) -> None:
        self._barrier.abort()

    def for_rank(self, rank: int) -> Collective:
        def run(node: Node, x: np.ndarray) -> np.ndarray:
            self._slots[rank] = x
            self._barrier.wait()
            parts = list(self._slots)
            self._barrier.wait()  # every rank has read the slots before any writes its next
            if node.op == "all_reduce":
                return np.sum(parts, axis=0, dtype=np.float32)
            return np.concatenate(parts, axis=-1)
        return run


class ShardedReference(ReferenceRunner):
    """ReferenceRunner over `world` ranks' graphs (fused by ir.fusion when `fused`, as the backends run them)."""

    def __init__(self, model: LoadedModel, world: int, max_tokens: int = 512, block_size: int = 16,
                 fused: bool = False):
        super().__init__(model, max_tokens, block_size)
        self.collectives = Collectives(world)
        self.graphs, self.interps = [], []
        for rank in range(world):
            graph = shard(model.graph, rank, world)
            weights = ShardedWeights(graph, model.weights)
            if fused:
                graph = fuse(graph)
                weights = FusedWeights(graph, weights)
            self.graphs.append(graph)
            self.interps.append(Interpreter(graph, weights, self.collectives.for_rank(rank)))
        self._pool = ThreadPoolExecutor(world)

    def _cache(self, n_seqs: int) -> list[KVCache]:
        return [KVCache.for_graph(g, n_seqs * self.blocks_per_seq, self.block_size) for g in self.graphs]

    def run_step(self, batch: Batch, cache: list[KVCache]) -> np.ndarray:
        """Rank 0's logits; every rank's must be the same."""
        runs = [self._pool.submit(self._run, it, batch, c) for it, c in zip(self.interps, cache, strict=True)]
        logits = [r.result()["logits"] for r in runs]
        for rank, other in enumerate(logits[1:], 1):
            if not np.array_equal(other, logits[0]):
                raise AssertionError(f"rank {rank}'s logits differ from rank 0's")
        return logits[0]

    def _run(self, interp: Interpreter, batch: Batch, cache: KVCache) -> dict:
        try:
            return interp.run(batch.inputs(), cache)
        except BaseException:
            self.collectives.abort()  # the other ranks would wait for this one's collectives
            raise
