"""An embedding model's step: every request is a prefill (chunked like any other) whose final-norm hidden states are
pooled into one vector (ir.pooling: last token, mean or first token), after which its KV blocks are freed at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from frontend.engine.outputs import CompletionOutput, RequestOutput, TokenView
from frontend.engine.scheduler import ScheduledSeq
from frontend.engine.sequence import Sequence
from ir.pooling import Pooling

if TYPE_CHECKING:
    from frontend.engine.engine import LLMEngine


class PoolingStep:
    """Runs the engine's steps for an embedding model: the rows each chunk contributes, their sums or picks kept
    per sequence between chunks, the vector reported when the prompt's last chunk has run."""

    def __init__(self, engine: LLMEngine, pooling: Pooling):
        self.engine, self.pooling = engine, pooling
        self.pooled: dict[Sequence, np.ndarray] = {}  # a sum (mean) or the picked row, while its prompt runs

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        for seq in [q for q in self.pooled if q.finished]:  # aborted mid-prompt
            del self.pooled[seq]
        scheduled = engine.scheduler.schedule()
        if not scheduled:
            return []
        batch = engine.make_batch(scheduled)
        rows, takes = self._rows(scheduled, batch.query_start)
        batch.logits_indices = np.asarray(rows, np.int32)
        hidden = engine.backend.to_host(engine.backend.forward(batch))
        engine.stats["steps"] += 1
        outputs = []
        for s, (lo, hi) in zip(scheduled, takes, strict=True):
            seq, last = s.seq, s.samples  # read before the chunk counts as computed
            if seq.num_computed_tokens == 0:  # a fresh start (a preempted sequence recomputes from its first token)
                self.pooled.pop(seq, None)
            if hi > lo:
                part = hidden[lo:hi].astype(np.float64).sum(0)
                self.pooled[seq] = part if seq not in self.pooled or self.pooling.mode != "mean" else \
                    self.pooled[seq] + part
            seq.num_computed_tokens += s.num_new
            engine.stats["prompt_tokens"] += s.num_new
            engine.blocks.commit(seq)
            if last:
                outputs.append(self._finish(seq, self.pooled.pop(seq)))
        return outputs

    def _rows(self, scheduled: list[ScheduledSeq], starts: np.ndarray) -> tuple[list[int], list[tuple[int, int]]]:
        """The batch rows whose hidden states the step returns, and each sequence's span of them."""
        rows: list[int] = []
        takes = []
        mode = self.pooling.mode
        for s, start in zip(scheduled, starts[:-1].tolist(), strict=True):
            lo = len(rows)
            if mode == "mean":
                rows.extend(range(start, start + s.num_new))
            elif mode == "last" and s.samples:
                rows.append(start + s.num_new - 1)
            elif mode == "cls" and s.seq.num_computed_tokens == 0:
                rows.append(start)
            takes.append((lo, len(rows)))
        return rows, takes

    def _finish(self, seq: Sequence, pooled: np.ndarray) -> RequestOutput:
        engine = self.engine
        vec = pooled / seq.num_prompt_tokens if self.pooling.mode == "mean" else pooled
        if self.pooling.normalize:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)  # torch's F.normalize eps
        engine.scheduler.finish(seq, "stop")
        req = engine.requests.pop(seq.request_id)
        done = CompletionOutput(0, [], 0, 0, TokenView([], 0), "stop", None, None, "", [])
        return RequestOutput(req.request_id, req.prompt_token_ids, [done], True, seq.num_cached_tokens,
                             embedding=vec.astype(np.float32))
