"""Continuous batching: each step mixes running decodes with new (possibly chunked) prefills.

A request is admitted when its blocks are free (in every KV group's pool, for a model of several). When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks are freed and it is
recomputed later (its generated tokens are kept, so nothing is lost and greedy output is unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from frontend.engine.block_manager import BlockManager
from frontend.engine.group_blocks import GroupedBlockManager
from frontend.engine.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    # While any stream waits for its next token, a step computes at most this many tokens in all (never fewer than
    # its decodes): new prompts then enter in smaller pieces beside the decodes (Sarathi-Serve's stall-free
    # batching). Off by default (0 or None: max_num_batched_tokens always): on the H200 at 512 it cut 256 streams'
    # ITL p99 from 92 to 53 ms but cost 15% of their throughput, and raised 64 streams' p99 from 12 to 17 ms (more
    # steps carry a prefill, so more tokens wait on one; docs/BENCHMARKS.md, 2026-12-02).
    decode_step_tokens: int | None = 0

    @property
    def step_tokens(self) -> int:
        """The most tokens one sequence computes in one step."""
        return min(self.max_num_batched_tokens, self.prefill_chunk_size)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager | GroupedBlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step_budget(self) -> int:
        """Tokens this step may compute: max_num_batched_tokens, or decode_step_tokens while a stream is waiting."""
        cfg = self.config
        if not cfg.decode_step_tokens:
            return cfg.max_num_batched_tokens
        streams = sum(1 for seq in self.running if seq.output_token_ids)
        if not streams:
            return cfg.max_num_batched_tokens
        return min(cfg.max_num_batched_tokens, max(cfg.decode_step_tokens, streams))

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.step_budget()
        out: list[ScheduledSeq] = []
        # Running sequences first, oldest first; they may preempt the newest ones.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_size)
            while not self.blocks.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: everything newer is gone too
            self.blocks.append_slots(seq, n)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # Then admissions, first come first served; a sibling waits for its parent's prefill.
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            parent = seq.parent
            if parent is not None and parent.finished:
                seq.parent = parent = None
            if parent is not None and not (parent.status is Status.RUNNING and parent.prefilled):
                skipped.append(self.waiting.popleft())
                continue
            if not self._admit(seq, parent):
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_size)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return out

    def _admit(self, seq: Sequence, parent: Sequence | None) -> bool:
        if parent is not None:
            if not self.blocks.can_fork(parent, seq):
                return False
            self.blocks.fork(parent, seq)
            return True
        if not self.blocks.can_allocate(seq):
            return False
        self.blocks.allocate(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free_seq(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason
