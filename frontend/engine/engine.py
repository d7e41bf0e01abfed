"""The step loop: schedule, build one flat batch, run the backend, sample, detokenize, stop."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace

import numpy as np

from backends.base import Backend
from core.batch import Batch, make_batch
from core.kv_layout import KVLimits
from core.sampler import TokenHistory, make_generator, needs_history
from core.sampling_params import SamplingParams
from frontend.engine.block_manager import BlockManager
from frontend.engine.detokenizer import IncrementalDetokenizer, NoText
from frontend.engine.group_blocks import GroupedBlockManager
from frontend.engine.outputs import CompletionOutput, RequestOutput, TokenView
from frontend.engine.pooling import PoolingStep
from frontend.engine.request_bounds import RequestBounds
from frontend.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from frontend.engine.sequence import Sequence, Status, TokenLogprob
from frontend.engine.stops import StopRules
from frontend.engine.token_masks import TokenMasks

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput"]  # the outputs live in outputs.py

log = logging.getLogger(__name__)
SLOW_LAUNCH_S = 0.25  # a step whose launch takes longer is logged (a steady step launches in milliseconds)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_bytes (several KV groups: group 0's; core.kv_layout)
    kv_cache_bytes: int | None = None  # None: kv_fraction, else the backend's default budget
    kv_fraction: float | None = None  # share of the memory free after loading
    max_model_len: int | None = None  # None: the model's context length
    prefix_caching: bool = True
    async_scheduling: bool = True  # overlap steps where the backend can (see LLMEngine.step)
    seed: int | None = None  # requests without a seed draw from streams derived from this one (None: OS entropy)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(slots=True)
class _Launched:
    """A step whose tokens were sampled on the device and are not read back yet."""

    seqs: list[Sequence]  # the sampling sequences, in row order
    slots: list[int]  # where each one's token goes in its output_token_ids
    pending: object  # .result() -> list[SampleResult]; None while a constrained step's masks are filled
    logits: object = None  # then the logits it will sample from


class Request:
    """The n sequences of one request; outputs are reported per request."""

    def __init__(self, request_id: str, prompt: list[int], seqs: list[Sequence]):
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.seqs = seqs
        self.reported_tokens = [0] * len(seqs)
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)


class LLMEngine:
    def __init__(self, backend: Backend, config: EngineConfig | None = None):
        self.backend = backend
        self.config = config = config or EngineConfig()
        model = backend.model
        self.tokenizer = model.tokenizer
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        if model.pooling is not None and model.pooling.mode != "last":  # a cached prefix's rows would be missed
            self.config = config = replace(config, prefix_caching=False)
        # Scheduler settings left unset take the backend's: its step size, its knee (scheduler.py's cost model) and
        # its burst threshold (scheduler.py's burst rule).
        defaults = {"max_num_batched_tokens": backend.default_step_tokens,
                    "decode_step_tokens": backend.step_knee_tokens,
                    "prefill_burst_tokens": backend.prefill_burst_tokens}
        unset = {k: v for k, v in defaults.items() if getattr(config.scheduler, k) is None}
        if unset:
            self.config = config = replace(config, scheduler=replace(config.scheduler, **unset))
        backend.set_limits(config.scheduler.max_num_seqs, self.max_model_len, config.scheduler.max_num_batched_tokens)
        self.blocks = self._make_blocks(backend, config)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.requests: dict[str, Request] = {}
        self.eos_ids = set(getattr(self.tokenizer, "eos_ids", ())) | set(model.config.eos_token_ids)
        self.masks = TokenMasks(self.tokenizer, model.config.vocab_size, self.eos_ids)
        self.stops = StopRules(frozenset(self.eos_ids), self.max_model_len)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "overlapped_steps": 0}
        # An embedding model's requests are prefills pooled into one vector each (pooling.py): nothing to overlap.
        self.pooler = PoolingStep(self, model.pooling) if model.pooling is not None else None
        self.overlap = config.async_scheduling and backend.chains_steps and self.pooler is None
        self._inflight: _Launched | None = None
        self._seeds = np.random.SeedSequence(config.seed) if config.seed is not None else None

    def _make_blocks(self, backend: Backend, config: EngineConfig) -> BlockManager | GroupedBlockManager:
        """Sizes the KV pools (one per KV group, split as core.kv_layout says), allocates them, and returns their
        block manager."""
        bs, sched = config.block_size, config.scheduler
        layout = backend.kv_layout()
        self._more_groups = range(1, layout.num_groups)  # the KV groups past the first (core.batch)
        limits = KVLimits(bs, sched.max_num_seqs, self.max_model_len, sched.step_tokens)
        if config.num_kv_blocks is not None:  # group 0's pool; the others follow the split rule
            pools = layout.pools(config.num_kv_blocks, limits)
        else:
            if config.kv_cache_bytes:
                budget = config.kv_cache_bytes
            elif config.kv_fraction:
                budget = backend.kv_budget(config.kv_fraction, sched.max_num_batched_tokens, bs)
            else:
                budget = backend.default_kv_bytes()
            if layout.num_groups == 1:
                pools = [max(1, budget // backend.kv_bytes_per_block(bs))]
            else:
                pools = layout.pools_for_budget(
                    budget, [backend.kv_bytes_per_block(bs, g) for g in range(layout.num_groups)], limits)
        if layout.num_groups == 1:
            backend.allocate_kv(pools[0], bs)
            log.info("KV cache: %d blocks of %d tokens (%d tokens)", pools[0], bs, pools[0] * bs)
            return BlockManager(pools[0], bs, config.prefix_caching)
        backend.allocate_kv(pools, bs)
        log.info("KV cache: %s blocks of %d tokens for KV groups of %s", "/".join(map(str, pools)), bs,
                 ", ".join(f"{len(g.layers)} layers {'window ' + str(g.window) if g.slides else 'full'}"
                           for g in layout.groups))
        return GroupedBlockManager(layout, pools, bs, config.prefix_caching, sched.step_tokens)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_token_ids]
        self.check_request(prompt, params)
        if self.pooler is not None and params.n != 1:
            raise ValueError(f"an embedding request has one sequence, not n={params.n}")
        if self.pooler is not None and params.structured is not None:
            raise ValueError("an embedding request generates nothing to constrain")
        # a GrammarError is a ValueError: the request is refused as any bad one, before a sequence is queued
        grammars = [self.masks.matcher(params.structured) for _ in range(params.n)] if params.structured else None
        seqs: list[Sequence] = []
        for i in range(params.n):
            if params.seed is not None:
                generator = make_generator(params.seed + i)
            elif self._seeds is not None:  # the engine's seed: one child stream per sequence, in arrival order
                generator = np.random.Generator(np.random.PCG64(self._seeds.spawn(1)[0]))
            else:
                generator = make_generator(None)
            history = needs_history(params)
            seq = Sequence(request_id, i, prompt, params, generator, parent=seqs[0] if seqs else None,
                           needs_history=history, history=TokenHistory(prompt) if history else None)
            seq.detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt, params)
                               if self.tokenizer and self.pooler is None else NoText())  # an embedding: no text
            seq.grammar = grammars[i] if grammars else None
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, prompt, seqs)
        return request_id

    @property
    def bounds(self) -> RequestBounds:
        return RequestBounds(self.backend.model.config.vocab_size, self.max_model_len, self.blocks.token_capacity)

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        self.bounds.check(prompt, None if self.pooler is not None else params)  # an embedding generates nothing

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req else ():
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; report what the sampled tokens changed.

        With a backend that `chains_steps` the steps overlap: a step's sampled tokens stay on the device (the
        sequences hold placeholders) and are read back during the next step, after it is launched, so the GPU
        never waits for the host's bookkeeping. The next step takes its input tokens from the device. A step that
        cannot be launched blind (a possible preemption, penalties that need the tokens, a sibling's fork) first
        reads back."""
        if self.pooler is not None:
            return self.pooler.step()
        prev, self._inflight = self._inflight, None
        touched: set[str] = set()
        if prev is not None and not self._can_chain():
            self._resolve(prev, touched)
            prev = None
        scheduled = self.scheduler.schedule()
        self.stats["overlapped_steps"] += prev is not None and bool(scheduled)
        if prev is not None and prev.pending is None:  # its masks were filled meanwhile: its sampling goes first
            self._sample_deferred(prev)
        launched = self._launch(scheduled, touched, prev is not None) if scheduled else None
        if prev is not None:
            self._resolve(prev, touched)
        if launched is not None and launched.pending is None:  # its masks needed prev's tokens, now read back
            self.masks.start(launched.seqs, launched.slots)  # filled off this thread until the next step samples
        for s in scheduled:  # after the read-back: block hashes need the tokens
            self.blocks.commit(s.seq)
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                self._resolve(launched, touched)
        return [self._report(self.requests[r]) for r in touched if r in self.requests]

    def _can_chain(self) -> bool:
        """Whether the next step can be scheduled before the last one's tokens are known: no running sequence can be
        preempted for a block, none with a pending token needs its tokens on the host, no waiting sibling (n > 1)
        forks from its parent, and some sequence will not stop by length. Prompts (admitted, or a chunk further)
        ride along: their tokens are on the host (docs/ARCHITECTURE.md says why that matters)."""
        sched = self.scheduler
        bs, chunk = self.blocks.block_size, self.config.scheduler.step_tokens
        need = 0  # blocks the running sequences can take this step, at most (admissions never preempt)
        live = False
        for seq in sched.running:
            if seq.pending:
                if seq.needs_history:
                    return False
                need += 1
                live = live or not self.stops.length_reached(seq, len(seq.output_token_ids))
            else:  # a prompt's next chunk (or a recomputed one's): every token known
                need += -(-min(seq.num_tokens - seq.num_computed_tokens, chunk) // bs) + 1
                live = True
        if not self.blocks.has_room_for(need):  # a block each: `need` blocks in every pool
            return False
        if any(seq.parent is not None for seq in sched.waiting):
            return False
        return live or bool(sched.waiting)

    def _launch(self, scheduled: list[ScheduledSeq], touched: set[str], chained: bool) -> _Launched | None:
        """Launch a step's forward and, unless it is `chained` behind an unread step and holds a constrained
        sequence, its sampling. Such a step's masks need that step's tokens: after the read-back they are filled on
        the library's threads while this thread finishes the step, and the next step() samples it before launching
        its own forward (the device runs this forward meanwhile)."""
        keep = [i for i, s in enumerate(scheduled) if s.samples]
        batch = self.make_batch(scheduled)
        batch.logits_indices = batch.logits_indices[keep]
        if self.overlap and any(s.seq.pending for s in scheduled):
            # per token (prompt chunks ride along in chained steps): a pending token is its sequence's last input
            batch.prev_rows = rows = np.full(batch.num_tokens, -1, np.int32)
            for i, s in enumerate(scheduled):
                if s.seq.pending:
                    rows[batch.query_start[i + 1] - 1] = s.seq.chain_row
        t0 = time.perf_counter()
        logits = self.backend.forward(batch)  # also for chunks that sample nothing: their K/V must be written
        if (took := time.perf_counter() - t0) > SLOW_LAUNCH_S:  # the host's part only: the GPU runs on
            log.warning("a step of %d tokens (%d sequences) took %.2f s to launch: kernels compiled on first use, or "
                        "a CUDA graph captured", batch.num_tokens, len(scheduled), took)
        self.stats["steps"] += 1
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new
            if s.seq.num_computed_tokens <= s.seq.num_prompt_tokens:
                self.stats["prompt_tokens"] += s.num_new
        seqs = [scheduled[i].seq for i in keep]
        if len(seqs) < len(scheduled):  # prompt chunks that sample nothing yet: their progress is reported now
            sampling = set(keep)
            touched.update(s.seq.request_id for i, s in enumerate(scheduled) if i not in sampling)
        if not seqs:
            return None
        slots = [len(seq.output_token_ids) for seq in seqs]
        defer = chained and any(seq.grammar is not None for seq in seqs)
        pending = None if defer else self._sample(logits, seqs, slots)
        for row, seq in enumerate(seqs):
            seq.output_token_ids.append(-1)
            seq.pending += 1
            seq.chain_row = row
        return _Launched(seqs, slots, pending, logits if defer else None)

    def _sample(self, logits, seqs: list[Sequence], counts: list[int]):
        """Start sampling one row per sequence; `counts[i]`: the tokens seqs[i] generated before this one."""
        if any(seq.grammar is not None for seq in seqs):  # else no row has a mask to set or clear: skip the walk
            self.masks.fill(seqs, counts)
        inputs: list = seqs
        for row, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            if n < seq.params.min_tokens and seq.grammar is None:  # a constrained one's mask bans its stops
                inputs = inputs if inputs is not seqs else list(seqs)
                inputs[row] = self.stops.min_tokens_view(seq)
        return self.backend.sample_async(logits, inputs)

    def make_batch(self, scheduled: list[ScheduledSeq]) -> Batch:
        """The step's flat batch: each scheduled chunk's tokens, positions and block tables (every KV group's)."""
        return make_batch([s.seq.tokens(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new)
                           for s in scheduled],
                          [s.seq.num_computed_tokens for s in scheduled],
                          [s.seq.block_array() for s in scheduled], self.config.block_size,
                          group_tables=[[s.seq.kv[g].array() for s in scheduled] for g in self._more_groups])

    def _sample_deferred(self, launched: _Launched) -> None:
        launched.pending = self._sample(launched.logits, launched.seqs, launched.slots)
        launched.logits = None

    def _resolve(self, launched: _Launched, touched: set[str]) -> None:
        """Read a launched step's tokens back: fill the placeholders, detokenize, stop."""
        if launched.pending is None:  # a constrained step not sampled yet
            self._sample_deferred(launched)
        results = launched.pending.result()
        now = time.monotonic()
        for seq, slot, res in zip(launched.seqs, launched.slots, results, strict=True):
            if seq.finished:  # aborted, or stopped by the step before: this token was never wanted
                continue
            touched.add(seq.request_id)
            if res.error is not None:
                self._fail_request(seq.request_id, res.error)
                continue
            complete = False
            if seq.grammar is not None:
                complete, error = self.masks.advance(seq, res.token)
                if error is not None:
                    self._fail_request(seq.request_id, error)
                    continue
            seq.output_token_ids[slot] = res.token
            if seq.history is not None:
                seq.history.add(res.token)
            seq.pending -= 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            self.stats["generation_tokens"] += 1
            if res.logprob is not None:
                seq.logprobs.append(TokenLogprob(res.token, res.logprob, res.top_logprobs))
            n_out = slot + 1
            stop_token = self.stops.is_stop_token(seq, res.token, n_out) or (complete and res.token in self.eos_ids)
            if not stop_token or seq.params.include_stop_str_in_output:
                seq.detokenizer.add(res.token)  # like vLLM, the EOS/stop token adds no text by default
            reason = self.stops.reason(seq, stop_token, n_out)
            if complete:  # nothing but the end may follow: it ends here (before min_tokens, or at max_tokens)
                reason = "stop"
            if reason is not None:
                del seq.output_token_ids[n_out:]  # a placeholder of a step launched blind
                seq.pending = 0
                if not seq.detokenizer.stopped:
                    seq.detokenizer.flush()  # text held back for a stop string that never came
                self.scheduler.finish(seq, reason)

    def _fail_request(self, request_id: str, error: str) -> None:
        """End every sequence of one request (a row its sampler could not serve); the others run on."""
        req = self.requests[request_id]
        req.error = error
        log.warning("request %s failed: %s", request_id, error)
        for seq in req.seqs:
            if not seq.finished:
                del seq.output_token_ids[len(seq.output_token_ids) - seq.pending:]  # placeholders
                seq.pending = 0
                self.scheduler.finish(seq, "abort")

    def _report(self, req: Request) -> RequestOutput:
        # Runs for every running request every step: plain attribute reads, and nothing that grows with the output
        # (see docs/BENCHMARKS.md: the engine's Python per step bounds batch-64 decode on a GPU). The outputs name
        # the sequence's token list and text pieces up to their current lengths (outputs.py says why that holds).
        outs = []
        for i, seq in enumerate(req.seqs):
            detok = seq.detokenizer
            pieces = detok.pieces
            num_pieces = len(pieces)
            delta = pieces[-1] if num_pieces == seq.reported_pieces + 1 else "".join(pieces[seq.reported_pieces:])
            seq.reported_pieces = num_pieces
            ids = seq.output_token_ids
            n = len(ids) - seq.pending
            new_ids = ids[req.reported_tokens[i]:n]
            req.reported_tokens[i] = n
            outs.append(CompletionOutput(seq.index, pieces, num_pieces, detok.text_len, TokenView(ids, n),
                                         seq.finish_reason, seq.stop_reason,
                                         seq.logprobs if seq.params.logprobs is not None else None, delta, new_ids))
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
        cached = req.seqs[0].num_cached_tokens if len(req.seqs) == 1 else max(s.num_cached_tokens for s in req.seqs)
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, finished, cached, req.error)

    # -- introspection ------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def all_blocks_free(self) -> bool:
        return self.blocks.num_free_blocks == self.blocks.num_blocks
