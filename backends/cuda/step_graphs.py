"""Steps that carry prefill tokens (a prompt, a chunk, decodes beside them) replayed as one CUDA graph each.

The piecewise graphs (backends.cuda.piecewise) leave attention eager because the prefill kernel's grid follows the
batch's shape; that costs a mixed step some 30 Python launches between graph replays and ~2x a decode step (the
inter-token latency's tail while prompts arrive). Here attention runs paged_prefill's mapped kernels instead: their
grid is fixed by a capacity (kernels_src.paged_prefill.tile_capacity) and each program finds its (sequence, tile) in
a map the host writes each step, so the whole step is one graph (vLLM does the same with its unified attention).

Graphs are keyed by (tokens rounded up to a bucket, logits rows rounded up to a bucket) and share one memory pool.
Inputs live in static device buffers sized for the largest key, as the decode graphs' (backends.cuda.graphs) do:
padding tokens are token 0, position 0, slot -1 (nothing written), owned by one more sequence of context 0, whose
attention rows come out zeros (no key is walked): padding rows hold finite values for the row-wise ops after (a MoE
router among them); padding logits rows read row 0. Block tables, context lengths and query starts are per
sequence at their full size: only the sequences the tile map names are read. Tokens the last step
sampled are gathered from the backend's chain on the device (Batch.prev_rows). The logits are copied into one
static buffer, so graphs keep no outputs of their own. A capture runs on padding inputs of its own (never the live
step's), and one that fails leaves its key to the pieces, logged once. No graphs for a rope that switches tables
on the sequence's length (longrope: it reads per-sequence metadata outside attention).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from backends.cuda.graphs import try_capture, warm_and_capture
from backends.cuda.piecewise import reads_metadata
from backends.cuda.runner import Runner
from backends.cuda.runtime import torch
from backends.cuda.step_meta import StepMeta
from core.batch import Batch
from kernels_src.paged_prefill import build_tile_map, tile_capacity, tile_key

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 512)
LOGIT_BUCKETS = (1, 8, 32, 64, 96, 128, 192, 256, 384, 512)


def _up_to(limit: int, buckets: tuple[int, ...]) -> list[int]:
    return [b for b in buckets if b < limit] + [limit]


class StepKeys:
    """Which graph serves a step: (tokens' bucket, logits rows' bucket), logits rows at most min(tokens, sequences).
    Plain Python, so that CI checks the bucket rules on a CPU."""

    def __init__(self, max_tokens: int, max_seqs: int):
        self.tokens, self.max_seqs = _up_to(max_tokens, TOKEN_BUCKETS), max_seqs

    def logits(self, tokens: int) -> list[int]:
        return _up_to(min(tokens, self.max_seqs), LOGIT_BUCKETS)

    def key(self, num_tokens: int, num_logits: int) -> tuple[int, int] | None:
        """The smallest key that holds the step, or None (more tokens or logits rows than any graph takes)."""
        t = next((b for b in self.tokens if b >= num_tokens), None)
        if t is None:
            return None
        rows = next((b for b in self.logits(t) if b >= num_logits), None)
        return None if rows is None else (t, rows)

    def all(self) -> list[tuple[int, int]]:
        """Every key, largest first (smaller captures then reuse the pool's memory)."""
        return [(t, rows) for t in reversed(self.tokens) for rows in reversed(self.logits(t))]


def tile_keys(runner: Runner) -> set[tuple[int, int]]:
    """(GQA group, row tile) of every attention layer: one tile map each (Runner._attend reads it by tile_key too)."""
    keys = set()
    for node in runner.graph.attention_nodes():
        kv_heads = runner.kv[node.attrs["layer"]][0].shape[2]
        keys.add(tile_key(int(node.inputs[0].shape[1]), kv_heads, int(node.inputs[0].shape[2])))
    return keys


def unavailable(runner: Runner) -> str | None:
    """Why no step can be one graph, or None."""
    why = reads_metadata(runner.graph)
    if why:
        return why
    if not runner.graph.attention_nodes():
        return "it has no attention over a KV cache"
    return None


class StepGraphs:
    """Whole-graph replays of steps with prefill tokens, up to `max_tokens` tokens of up to `max_seqs` sequences.
    `capture=False` runs each step eagerly on the same static buffers (a CPU test's check of the bookkeeping)."""

    def __init__(self, runner: Runner, chain: torch.Tensor, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 capture: bool = True):
        self.runner, self.chain, self.capture = runner, chain, capture
        self.why_not = unavailable(runner)
        self.keys = StepKeys(max_tokens, max_seqs)
        self.max_seqs, self.num_groups = max_seqs, 1 + max(runner.group_of, default=0)
        t, s, m = self.keys.tokens[-1], max_seqs + 1, max(1, max_blocks_per_seq)  # s: the padding sequence too
        self.maps = {k: self.capacity(t, k) for k in tile_keys(runner)}
        shapes = {"tokens": ((t,), torch.int32), "prev": ((t,), torch.int32), "positions": ((t,), torch.int32),
                  "ctx": ((s,), torch.int32), "qstart": ((s + 1,), torch.int32),
                  "logits": ((self.keys.logits(t)[-1],), torch.int32)}
        for g in range(self.num_groups):
            shapes |= {f"slots{g}": ((t,), torch.int64), f"tables{g}": ((s, m), torch.int32)}
        shapes |= {f"map{k}": ((cap, 2), torch.int32) for k, cap in self.maps.items()}
        self.shapes = shapes
        cuda = runner.device.type == "cuda"
        self._host = [{k: torch.zeros(sh, dtype=dt, pin_memory=cuda) for k, (sh, dt) in shapes.items()}
                      for _ in range(2 if cuda else 1)]  # two sets: the next step is written while copies queue
        self._copied = [torch.cuda.Event() for _ in self._host] if cuda else []
        self._turn = 0
        self._dev = {k: torch.zeros(sh, dtype=dt, device=runner.device) for k, (sh, dt) in shapes.items()}
        self.out: torch.Tensor | None = None  # [max logits rows, vocab] fp32: every graph's logits
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self.failed: dict[tuple[int, int], str] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_s = self.capture_mib = 0.0  # capture_all's time and the memory it reserved

    @property
    def available(self) -> bool:
        return self.why_not is None

    def applies(self, batch: Batch) -> bool:
        width = self.shapes["tables0"][0][1]
        return (self.available and not batch.is_decode and len(batch.context_lens) <= self.max_seqs
                and self.keys.key(batch.num_tokens, len(batch.logits_indices)) is not None
                and batch.num_groups == self.num_groups
                and all(batch.kv_group(g)[1].shape[1] <= width for g in range(self.num_groups)))

    def capacity(self, tokens: int, tile_key: tuple[int, int]) -> int:
        return tile_capacity(tokens, self.max_seqs + 1, *tile_key)

    def capture_all(self) -> None:
        if not self.available:
            log.info("no whole-step CUDA graphs for prefill steps: %s", self.why_not)
            return
        dev = self.runner.device
        t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved(dev) if self.capture else 0
        for key in self.keys.all():
            self._try_capture(key)
        if self.capture:
            self.capture_s = time.perf_counter() - t0
            self.capture_mib = (torch.cuda.memory_reserved(dev) - mem0) / 2**20
            log.info("captured %d whole-step CUDA graphs for prefill steps (tokens %s, up to %d sequences) in %.1f s, "
                     "%.0f MiB", len(self.graphs), ",".join(map(str, self.keys.tokens)), self.max_seqs,
                     self.capture_s, self.capture_mib)

    def _meta(self, t: int) -> StepMeta:
        d = self._dev
        groups = tuple((d[f"slots{g}"][:t], d[f"tables{g}"]) for g in range(1, self.num_groups))
        maps = {k: d[f"map{k}"][:self.capacity(t, k)] for k in self.maps}
        return StepMeta(d["positions"][:t], d["slots0"][:t], d["tables0"], d["ctx"], d["qstart"], decode=False,
                        max_query_len=t, max_context=0, groups=groups, tile_maps=maps)

    def _step(self, key: tuple[int, int]) -> None:
        """The step on the static buffers: tokens (the chain's where prev >= 0), the graph, logits into `out`."""
        t, rows = key
        d = self._dev
        prev = d["prev"][:t]
        ids = torch.where(prev >= 0, self.chain.index_select(0, prev.clamp(min=0)), d["tokens"][:t])
        logits = self.runner.run(ids, d["logits"][:rows], self._meta(t))
        if self.out is None:
            self.out = torch.empty((self._dev["logits"].shape[0], logits.shape[1]), dtype=torch.float32,
                                   device=logits.device)
        self.out[:rows].copy_(logits)

    def _try_capture(self, key: tuple[int, int]) -> bool:
        return try_capture(self.failed, key, self._capture,
                           "whole steps of %d tokens, %d logits rows (those steps run in pieces)")

    def _capture(self, key: tuple[int, int]) -> None:
        """Warms up and captures on padding inputs of its own: every token padding, owned by one sequence of context
        0 (so the warm-up's attention rows are zeros, never stale memory a MoE router would read)."""
        t = key[0]
        for name, buf in self._dev.items():
            buf.fill_(-1 if name == "prev" or name.startswith("slots") else 0)
        self._dev["qstart"][1:].fill_(t)
        for k in self.maps:
            tiles = build_tile_map(np.array([0, t]), *k, self.capacity(t, k))
            self._dev[f"map{k}"][:len(tiles)].copy_(torch.from_numpy(tiles))
        if not self.capture:
            self.graphs[key] = None
            return
        self.graphs[key] = warm_and_capture(lambda: self._step(key), self.pool)[0]

    def __call__(self, batch: Batch) -> torch.Tensor | None:
        """The step's logits [len(logits_indices), vocab] (a view of the static buffer, valid until the next step),
        or None when its graph could not be captured (run it in pieces)."""
        n, seqs, rows = batch.num_tokens, len(batch.context_lens), len(batch.logits_indices)
        key = self.keys.key(n, rows)
        if key not in self.graphs:  # before this step's inputs are copied in: the capture overwrites them
            log.info("capturing a whole-step CUDA graph for %d tokens, %d logits rows", *key)
            if not self._try_capture(key):
                return None
        t, lrows = key
        host = self._host[self._turn]
        if self._copied:
            self._copied[self._turn].synchronize()  # its last copies are done (long since, in practice)
        h = {k: v.numpy() for k, v in host.items()}
        h["tokens"][:n], h["tokens"][n:t] = np.maximum(batch.token_ids, 0), 0
        h["prev"][:n] = -1 if batch.prev_rows is None else batch.prev_rows
        h["prev"][n:t] = -1
        h["positions"][:n], h["positions"][n:t] = batch.positions, 0
        h["ctx"][:seqs], h["ctx"][seqs] = batch.context_lens, 0
        h["qstart"][:seqs + 1], h["qstart"][seqs + 1] = batch.query_start, t  # the padding sequence: tokens n..t
        h["logits"][:rows], h["logits"][rows:lrows] = batch.logits_indices, 0
        for g in range(self.num_groups):
            slots, tables = batch.kv_group(g)
            h[f"slots{g}"][:n], h[f"slots{g}"][n:t] = slots, -1
            h[f"tables{g}"][:seqs, :tables.shape[1]] = np.maximum(tables, 0)
        for k in self.maps:
            build_tile_map(h["qstart"][:seqs + 2], *k, self.capacity(t, k), out=h[f"map{k}"][:self.capacity(t, k)])
        used = {"ctx": seqs + 1, "qstart": seqs + 2, "logits": lrows} | {f"tables{g}": seqs
                                                                          for g in range(self.num_groups)}
        used |= {f"map{k}": self.capacity(t, k) for k in self.maps}
        for name, src in host.items():
            m = used.get(name, t)
            self._dev[name][:m].copy_(src[:m], non_blocking=True)
        if self._copied:
            self._copied[self._turn].record()
            self._turn ^= 1
        graph = self.graphs[key]
        if graph is None:
            self._step(key)
        else:
            graph.replay()
        return self.out[:rows]
