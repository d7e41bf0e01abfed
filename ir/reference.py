"""Reference generation through the numpy interpreter: the answers every backend must reproduce."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.batch import make_batch
from ir.fusion import FusedWeights, fuse
from ir.interpreter import Interpreter, KVCache
from ir.loader import LoadedModel


class ReferenceRunner:
    """Runs one or more sequences through the interpreter with a simple contiguous block layout."""

    def __init__(self, model: LoadedModel, max_tokens: int = 512, block_size: int = 16, fused: bool = False):
        """`fused`: run ir.fusion's graph, as the backends do (the plain graph is the reference)."""
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_tokens // block_size)
        graph = fuse(model.graph) if fused else model.graph
        self.interp = Interpreter(graph, FusedWeights(graph, model.weights) if fused else model.weights)

    def _cache(self, n_seqs: int) -> KVCache:
        return KVCache.for_graph(self.model.graph, n_seqs * self.blocks_per_seq, self.block_size)

    def _table(self, seq: int) -> list[int]:
        # Reverse order on purpose, so that a backend which ignores the block table gets it wrong.
        first = seq * self.blocks_per_seq
        return list(range(first + self.blocks_per_seq - 1, first - 1, -1))

    def prompt_logits(self, prompt: Sequence[int]) -> np.ndarray:
        """Logits for every prompt position, [len(prompt), vocab]."""
        batch = make_batch([prompt], [0], [self._table(0)], self.block_size, all_logits=True)
        return self.interp.run(batch.inputs(), self._cache(1))["logits"]

    def greedy(self, prompts: Sequence[Sequence[int]], max_new: int, suppress: Sequence[int] = (),
               stop: Sequence[int] = ()) -> tuple[list[list[int]], np.ndarray]:
        """Greedy continuation of each prompt (decoded together, one step per token), and the first
        step's logits [len(prompts), vocab] before suppression. A sequence ends after a `stop` id."""
        cache = self._cache(len(prompts))
        tables = [self._table(i) for i in range(len(prompts))]
        chunks = [list(p) for p in prompts]
        cached = [0] * len(prompts)
        outs: list[list[int]] = [[] for _ in prompts]
        first = None
        for _ in range(max_new):
            if all(o and o[-1] in stop for o in outs):
                break
            batch = make_batch(chunks, cached, tables, self.block_size)
            logits = self.interp.run(batch.inputs(), cache)["logits"]
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
