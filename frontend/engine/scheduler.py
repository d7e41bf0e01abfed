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

# The other answer to a burst of prompts (many streams starting together, as a closed loop's waves or a client's
# batch do): prefill the burst first, decodes paused (SGLang's default, vLLM's before chunked prefill). Mixed steps
# of a full budget lengthen every running stream's gap once per step of the burst: a stream started in the first of
# a burst's k steps waits k-1 long gaps; paused, it waits one gap as long as those k-1 steps together, and its next
# token comes no later. The decodes lose no time and the prompts' first tokens come sooner (their steps carry no
# decode rows), while a stream's long gaps fall from k-1 to one. Small arrivals (fewer prompt tokens than
# prefill_burst_tokens) still ride beside the decodes. A pause covers the prompts there when it began (later arrivals
# may fill a step's room but never extend it) and is followed by at least one step with every decode, so decodes
# always progress; a burst whose next prompt cannot be admitted (blocks, max_num_seqs) ends at once. Measured on an
# H200 (docs/BENCHMARKS.md, 2026-12-04) it lost to plain mixed steps: a pause also stops the previous wave's streams,
# and the p99 counts gaps, not streams. Larger steps (Backend.default_step_tokens) were the answer there; the rule
# stays off by default.


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 2048  # None: the backend's (backend.default_step_tokens, by LLMEngine)
    prefill_chunk_size: int = 512
    # While any stream waits for its next token, a step computes at most max(this, decode_step_ratio x streams,
    # streams + prompt tokens left / prefill_spread_steps) tokens, and never fewer than its decodes (the comment above
    # says why). None (the default): the backend's knee, filled in by LLMEngine (backend.step_knee_tokens); 0: off,
    # max_num_batched_tokens always (the rule before 2026-12-03: whole waiting prompts landed in one step).
    decode_step_tokens: int | None = None
    decode_step_ratio: float = DECODE_STEP_RATIO
    prefill_spread_steps: int = PREFILL_SPREAD_STEPS
    # At least this many prompt tokens waiting (or part-computed) while streams decode make the steps that follow
    # prompts only, decodes paused, until those prompts are computed (the comment above says why). None (the
    # default): the backend's (backend.prefill_burst_tokens, filled in by LLMEngine); 0: off, every step mixed.
    prefill_burst_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.decode_step_tokens is not None and self.decode_step_tokens < 0:
            raise ValueError(f"decode_step_tokens must be >= 0 (0: off), not {self.decode_step_tokens}")
        if self.decode_step_ratio < 1:
            raise ValueError(f"decode_step_ratio must be >= 1 (a step holds every decode), not "
                             f"{self.decode_step_ratio}")
        if self.prefill_spread_steps < 1:
            raise ValueError(f"prefill_spread_steps must be >= 1, not {self.prefill_spread_steps}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, not {self.max_num_batched_tokens}")
        if self.prefill_burst_tokens is not None and self.prefill_burst_tokens < 0:
            raise ValueError(f"prefill_burst_tokens must be >= 0 (0: off), not {self.prefill_burst_tokens}")

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
        self.burst: set[int] | None = None  # ids of the prompts a decode pause is prefilling (None: no pause)
        self._burst_allowed = True  # False for the one full step after a pause ends
        self.num_paused_steps = 0

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
            if self._decoding(seq):
                streams += 1
            else:
                left += seq.num_tokens - seq.num_computed_tokens
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

    @staticmethod
    def _decoding(seq: Sequence) -> bool:
        """Whether seq's next step is a decode: its last token (or the placeholder of one being sampled) its input."""
        return seq.num_tokens - seq.num_computed_tokens == 1 and bool(seq.output_token_ids)

    def _pending_prompts(self) -> list[Sequence]:
        """Sequences with prompt tokens (or a preempted sequence's tokens) still to compute, oldest first."""
        return [s for s in self.running if not self._decoding(s)] + list(self.waiting)

    def _pause_decodes(self) -> bool:
        """Whether this step is prompts only (the burst rule above); starts, continues or ends a pause."""
        threshold = self.config.prefill_burst_tokens
        if not threshold:
            return False
        if self.burst is not None:
            pending = {id(s) for s in self._pending_prompts()}
            if pending & self.burst:
                return True
            self.burst, self._burst_allowed = None, False  # the pause is over: one step with every decode first
            return False
        if not self._burst_allowed:
            self._burst_allowed = True
            return False
        if not any(self._decoding(s) for s in self.running):
            return False  # nothing to pause: a step of prompts is what the budget gives anyway
        pending = self._pending_prompts()
        if sum(s.num_tokens - s.num_computed_tokens for s in pending) < threshold:
            return False
        self.burst = {id(s) for s in pending}
        return True

    def schedule(self) -> list[ScheduledSeq]:
        paused = self._pause_decodes()
        budget = self.config.max_num_batched_tokens if paused else self.step_budget()
        out: list[ScheduledSeq] = []
        # Running sequences first, oldest first; they may preempt the newest ones.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if paused and self._decoding(seq):
                i += 1
                continue
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
                self._end_burst()  # the rest waits for blocks that only decodes finishing can free
                break
            self.waiting.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_size)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if paused:
            if len(self.running) >= self.config.max_num_seqs and self.waiting:
                self._end_burst()  # the rest waits for a stream to finish
            if not out:  # nothing of the burst could run: a full step instead, decodes too
                self._end_burst()
                return self.schedule()
            self.num_paused_steps += 1
        return out

    def _end_burst(self) -> None:
        if self.burst is not None:
            self.burst, self._burst_allowed = None, False

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
