"""Reference generation through the numpy interpreter: the answers every backend must reproduce."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.batch import Batch, make_batch
from ir.fusion import FusedWeights, fuse
from ir.interpreter import Interpreter, KVCache
from ir.kv_groups import kv_layout
from ir.loader import LoadedModel


class ReferenceRunner:
    """Runs one or more sequences through the interpreter with a simple contiguous block layout (in every KV group's
    pool: nothing is let go)."""

    def __init__(self, model: LoadedModel, max_tokens: int = 512, block_size: int = 16, fused: bool = False):
        """`fused`: run ir.fusion's graph, as the backends do (the plain graph is the reference)."""
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_tokens // block_size)
        graph = fuse(model.graph) if fused else model.graph
        self.interp = Interpreter(graph, FusedWeights(graph, model.weights) if fused else model.weights)
        self.num_groups = kv_layout(model.graph).num_groups

    def _cache(self, n_seqs: int) -> KVCache:
        return KVCache.for_graph(self.model.graph, n_seqs * self.blocks_per_seq, self.block_size)

    def run_step(self, batch: Batch, cache) -> np.ndarray:
        """One step's logits (ir.tp_reference runs it over several ranks)."""
        return self.interp.run(batch.inputs(), cache)["logits"]

    def _table(self, seq: int, group: int = 0) -> list[int]:
        # Reverse order on purpose, so that a backend which ignores the block table gets it wrong; each KV group's
        # turned by its number, so that one which reads another group's table gets it wrong too.
        first = seq * self.blocks_per_seq
        table = list(range(first + self.blocks_per_seq - 1, first - 1, -1))
        return table[group:] + table[:group]

    def batch(self, chunks: Sequence[Sequence[int]], cached: Sequence[int], all_logits: bool = False) -> Batch:
        """The step of sequences 0..len(chunks)-1 (their new tokens and counts already cached), every group's tables."""
        n = len(chunks)
        return make_batch(chunks, cached, [self._table(i) for i in range(n)], self.block_size, all_logits,
                          [[self._table(i, g) for i in range(n)] for g in range(1, self.num_groups)])

    def prompt_logits(self, prompt: Sequence[int]) -> np.ndarray:
        """Logits for every prompt position, [len(prompt), vocab]."""
        return self.run_step(self.batch([prompt], [0], all_logits=True), self._cache(1))

    def greedy(self, prompts: Sequence[Sequence[int]], max_new: int, suppress: Sequence[int] = (),
               stop: Sequence[int] = ()) -> tuple[list[list[int]], np.ndarray]:
        """Greedy continuation of each prompt (decoded together, one step per token), and the first
        step's logits [len(prompts), vocab] before suppression. A sequence ends after a `stop` id."""
        cache = self._cache(len(prompts))
        chunks = [list(p) for p in prompts]
        cached = [0] * len(prompts)
        outs: list[list[int]] = [[] for _ in prompts]
        first = None
        for _ in range(max_new):
            if all(o and o[-1] in stop for o in outs):
                break
            logits = self.run_step(self.batch(chunks, cached), cache)
            if first is None:
                first = logits.copy()
            logits[:, list(suppress)] = -np.inf
            nxt = logits.argmax(-1)
            for i, t in enumerate(nxt):
                if outs[i] and outs[i][-1] in stop:
                    continue  # finished; it still rides along in the batch, its output is frozen
                outs[i].append(int(t))
                cached[i] += len(chunks[i])
                chunks[i] = [int(t)]
        return outs, first
