"""Continuous batching: each step mixes running decodes with new (possibly chunked) prefills.

A request is admitted when its blocks are free (in every KV group's pool, for a model of several). When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks are freed and it is
recomputed later (its generated tokens are kept, so nothing is lost and greedy output is unchanged).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from frontend.engine.block_manager import BlockManager
from frontend.engine.group_blocks import GroupedBlockManager
from frontend.engine.sequence import Sequence, Status

# While streams decode, a step that also prefills should cost about what a decode-only step costs. The cost model: a
# step reads the weights once (a fixed time) and computes each of its rows (a time per row). Below the "knee" (the
# rows whose compute takes as long as the weight read, less what a prefill step's own overheads cost: the backend's
# `step_knee_tokens`: near 128 on an H200, not yet the default there; a CPU has none: every row costs compute) rows are
# nearly free; above it a step costs in proportion to its rows. So a step that carries prefill tokens takes at most
# max(knee, DECODE_STEP_RATIO x decoding streams) tokens: at the knee it costs about one weight read, past it about
# DECODE_STEP_RATIO x the decode-only step. New prompts are spread over the steps that follow (Sarathi-Serve's
# stall-free batching) instead of landing whole in one step.
# One more term keeps the prefill work from falling behind where prompts bring more tokens than the decodes leave
# room for (a prompt as long as its answer needs a prefill token per decode): the step also takes 1/PREFILL_SPREAD_STEPS
# of the prompt tokens still to compute, so a burst of arrivals is spread over about that many steps, the steps of a
# steady load carry equal shares (the same cost each: what an inter-token latency's p99 against its p50 asks), and a
# prompt waits about that many steps, never unboundedly.
DECODE_STEP_RATIO = 1.5  # below 2: a p99 gap within 2x the median, with room for a prefill step's overheads
PREFILL_SPREAD_STEPS = 16


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    # While any stream waits for its next token, a step computes at most max(this, decode_step_ratio x streams,
    # streams + prompt tokens left / prefill_spread_steps) tokens, and never fewer than its decodes (the comment above
    # says why). None (the default): the backend's knee, filled in by LLMEngine (backend.step_knee_tokens); 0: off,
    # max_num_batched_tokens always (the rule before 2026-12-03: whole waiting prompts landed in one step).
    decode_step_tokens: int | None = None
    decode_step_ratio: float = DECODE_STEP_RATIO
    prefill_spread_steps: int = PREFILL_SPREAD_STEPS

    def __post_init__(self) -> None:
        if self.decode_step_tokens is not None and self.decode_step_tokens < 0:
            raise ValueError(f"decode_step_tokens must be >= 0 (0: off), not {self.decode_step_tokens}")
        if self.decode_step_ratio < 1:
            raise ValueError(f"decode_step_ratio must be >= 1 (a step holds every decode), not "
                             f"{self.decode_step_ratio}")
        if self.prefill_spread_steps < 1:
            raise ValueError(f"prefill_spread_steps must be >= 1, not {self.prefill_spread_steps}")

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
        """Tokens this step may compute: max_num_batched_tokens, or while a stream decodes the module's rule:
        max(decode_step_tokens, decode_step_ratio x streams, streams + prompt tokens left / prefill_spread_steps)."""
        cfg = self.config
        if not cfg.decode_step_tokens:  # 0: off; None: not yet set by the engine (a bare Scheduler): off
            return cfg.max_num_batched_tokens
        streams = left = 0
        for seq in self.running:
            todo = seq.num_tokens - seq.num_computed_tokens
            if todo == 1 and seq.output_token_ids:
                streams += 1  # decoding: its last token (or the placeholder of one being sampled) is its input
            else:
                left += todo
        if not streams:
            return cfg.max_num_batched_tokens
        budget = max(cfg.decode_step_tokens, math.ceil(cfg.decode_step_ratio * streams))
        cap = cfg.max_num_batched_tokens
        spread = cfg.prefill_spread_steps
        for seq in self.waiting:  # stops once the spread term alone reaches the cap (a long queue costs no more)
            if streams + left // spread >= cap:
                break
            left += seq.num_tokens - seq.num_computed_tokens
        return min(cap, max(budget, streams + -(-left // spread)))

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
