"""Steps that hold prefill tokens, replayed in pieces: CUDA graphs over everything but attention (as vLLM's
piecewise graphs).

A prefill or mixed step launches as many kernels as a decode step, ~300 for an 8B model, and launching them from
Python costs more host time than a few hundred tokens take on the GPU; but its attention depends on the batch's
shape (how many sequences, their query lengths: the prefill kernel's grid), so the step cannot be one graph.
Everything else in a decoder works row by row on the step's tokens. So the graph's nodes are cut at each attention
node into pieces, and each piece is captured per token-count bucket over static buffers padded to the bucket. A step
copies its tokens and positions in, replays piece 0, runs attention 0 eagerly on its real rows into a static buffer,
replays piece 1, and so on; the tail from the first node that reads `logits_indices` (a number of rows that varies)
runs eagerly too.

- Padding rows hold stale but valid tokens and positions, and stale attention output. Every op outside attention is
  row-wise (a linear, a norm, a rope, an activation; a MoE routes each row on its own), so they never reach a real
  row, and attention only ever sees the real rows.
- Memory: all pieces share one pool. A value is held from the piece that writes it until the last reader (the capture
  frees it then, and later captures reuse its memory, which is safe because every step replays its pieces in capture
  order); values attention reads stay held, since the eager attention reads them at replay. A bucket's attention
  outputs share one buffer when the next piece is their only reader.
- A graph whose step reads metadata beyond positions outside attention (a longrope table switching on sequence
  length) gets no pieces: `plan` says why. (MoE experts, dense or GGUF, run on fixed-shape grids: kernels_src/moe.py.)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from backends.cuda.graphs import try_capture
from backends.cuda.runner import Runner
from backends.cuda.runtime import torch
from backends.cuda.step_meta import StepMeta
from ir.graph import Graph, Node
from ir.rope import long_after

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
ATTENTION = ("attention", "rope_attention", "latent_attention")  # ops that read the batch's shape


@dataclass
class Plan:
    """A graph cut for piecewise replay: ("graph", nodes) and ("attention", [node]) steps in order, then the tail."""

    steps: list[tuple[str, list[Node]]]
    tail: list[Node]
    last_read: dict[int, int] = field(default_factory=dict)  # value id -> index of the last step reading it
    attention_reads: set[int] = field(default_factory=set)  # value ids an attention step reads
    tail_reads: set[int] = field(default_factory=set)  # value ids the eager tail reads from the pieces


def reads_metadata(graph: Graph) -> str | None:
    """Why `graph`'s steps read per-sequence metadata outside attention (so no CUDA graph may hold those ops: the
    pieces' and the whole-step graphs' shared refusal), or None."""
    if any(long_after(s) is not None for s in graph.rope_specs()):
        return "its rope switches tables on the sequence's length (longrope), which reads the step's metadata"
    return None


def plan(graph: Graph) -> Plan | str:
    """The pieces of `graph`, or why it has none."""
    why = reads_metadata(graph)
    if why:
        return why
    logits_ids = {graph.inputs["logits_indices"].id} if "logits_indices" in graph.inputs else set()
    steps: list[tuple[str, list[Node]]] = []
    tail: list[Node] = []
    for node in graph.nodes:
        if tail or any(v is not None and v.id in logits_ids for v in node.inputs):
            tail.append(node)
            logits_ids.update(v.id for v in node.outs)
        elif node.op in ATTENTION:
            steps.append(("attention", [node]))
        elif steps and steps[-1][0] == "graph":
            steps[-1][1].append(node)
        else:
            steps.append(("graph", [node]))
    if not any(kind == "attention" for kind, _ in steps):
        return "it has no attention to cut it at"
    p = Plan(steps, tail)
    for i, (kind, nodes) in enumerate(steps):
        for node in nodes:
            for v in node.inputs:
                if v is not None and v.kind != "param":
                    p.last_read[v.id] = i
                    if kind == "attention":
                        p.attention_reads.add(v.id)
    made_in_tail = {v.id for node in tail for v in node.outs}
    for node in tail:
        for v in node.inputs:
            if v is not None and v.kind != "param":
                p.last_read[v.id] = len(steps)
                if v.id not in made_in_tail:
                    p.tail_reads.add(v.id)
    return p


@dataclass
class _Bucket:
    tokens: torch.Tensor  # [T] int32, static
    positions: torch.Tensor  # [T] int32, static
    meta: StepMeta  # what the pieces read of a step's metadata: the static positions
    env: dict  # value id -> the static tensors replays write and read (what the plan keeps)
    graphs: list  # per step: a CUDAGraph, or None for an attention step
    outs: dict[int, torch.Tensor]  # attention output value id -> its static buffer


class PiecewiseGraphs:
    """Replays steps of up to `max_tokens` tokens that the decode graphs do not serve. `capture=False` runs each
    piece eagerly on the same static buffers instead of replaying a graph (a CPU test's check of the bookkeeping)."""

    def __init__(self, runner: Runner, max_tokens: int, capture: bool = True):
        self.runner, self.capture = runner, capture
        self.plan = plan(runner.graph)
        self.buckets = [b for b in TOKEN_BUCKETS if b < max_tokens] + [max_tokens]
        self.captured: dict[int, _Bucket] = {}
        self.failed: dict[int, str] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def available(self) -> bool:
        return isinstance(self.plan, Plan)

    def applies(self, num_tokens: int) -> bool:
        return self.available and num_tokens <= self.buckets[-1]

    def capture_all(self) -> None:
        """Every bucket, largest first (smaller ones then reuse the pool's memory)."""
        if not self.available:
            log.info("no piecewise CUDA graphs for prefill steps: %s", self.plan)
            return
        dev = self.runner.device
        t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved(dev) if self.capture else 0
        for b in reversed(self.buckets):
            self._try_capture(b)
        if self.capture:
            log.info("captured piecewise CUDA graphs for prefill steps of up to %s tokens (%d buckets, %d pieces each) "
                     "in %.1f s, %.0f MiB", self.buckets[-1], len(self.captured),
                     sum(k == "graph" for k, _ in self.plan.steps), time.perf_counter() - t0,
                     (torch.cuda.memory_reserved(dev) - mem0) / 2**20)

    def _try_capture(self, b: int) -> bool:
        def capture(b: int) -> None:
            self.captured[b] = self._capture(b)

        return try_capture(self.failed, b, capture, "piecewise %d-token steps (they run eagerly)")

    def _capture(self, b: int) -> _Bucket:
        r, dev = self.runner, self.runner.device
        tokens = torch.zeros(b, dtype=torch.int32, device=dev)
        positions = torch.zeros(b, dtype=torch.int32, device=dev)
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        # what a piece may read of the metadata: positions (the ropes); anything else fails the capture loudly
        meta = StepMeta(positions, None, None, None, None, decode=False, max_query_len=0, max_context=0)
        shared: dict[tuple, torch.Tensor] = {}

        def bucket() -> _Bucket:
            return _Bucket(tokens, positions, meta, r.input_env(tokens, empty, positions), [], {})

        if self.capture:  # compile every kernel before capturing (a warm-up pass of the pieces on a side stream)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._pass(bucket(), shared, b, graphs=False)
            torch.cuda.current_stream().wait_stream(stream)
        captured = bucket()
        self._pass(captured, shared, b, graphs=self.capture)
        return captured

    def _pass(self, bucket: _Bucket, shared: dict, b: int, graphs: bool) -> None:
        """One pass over the plan: graph steps run (and are captured when `graphs`), attention steps get their
        static output; values past their last reader are dropped unless attention reads them."""
        r, p, env, meta = self.runner, self.plan, bucket.env, bucket.meta
        for i, (kind, nodes) in enumerate(p.steps):
            if kind == "attention":
                node = nodes[0]
                bucket.outs[node.outs[0].id] = env[node.outs[0].id] = self._attention_out(node, env, shared, i, b)
                bucket.graphs.append(None)
            elif graphs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    r.run_nodes(nodes, env, meta)
                bucket.graphs.append(g)
            else:
                r.run_nodes(nodes, env, meta)
                bucket.graphs.append(None)
            for vid in [v for v in env if p.last_read.get(v, -1) <= i and v not in p.attention_reads]:
                del env[vid]  # read by nothing later: its memory may serve later pieces' values

    def _attention_out(self, node: Node, env: dict, shared: dict, i: int, b: int) -> torch.Tensor:
        q, out = env[node.inputs[0].id], node.outs[0]
        shape, vid = (b, *(int(d) for d in out.shape[1:])), out.id  # [T, Hq, Dv]: T is the bucket
        if self.plan.last_read.get(vid) != i + 1:  # read past the next piece: a buffer of its own
            return torch.zeros(shape, dtype=q.dtype, device=q.device)
        key = (shape, q.dtype)
        if key not in shared:
            shared[key] = torch.zeros(shape, dtype=q.dtype, device=q.device)
        return shared[key]

    def run(self, token_ids: torch.Tensor, logits_indices: torch.Tensor, meta: StepMeta) -> torch.Tensor | None:
        """fp32 logits as Runner.run gives them, or None when this step's bucket could not be captured."""
        n = token_ids.shape[0]
        b = next(x for x in self.buckets if x >= n)
        if b not in self.captured and not self._try_capture(b):
            return None
        r, bucket = self.runner, self.captured[b]
        bucket.tokens[:n].copy_(token_ids)
        bucket.positions[:n].copy_(meta.positions)
        r._step_rows = {}
        # the tail's values are this step's own; the inputs are the static buffers the pieces were captured over
        env = bucket.env | r.input_env(bucket.tokens, logits_indices, bucket.positions)
        for (kind, nodes), g in zip(self.plan.steps, bucket.graphs, strict=True):
            if kind == "attention":
                node = nodes[0]
                args = [a[:n] if isinstance(a, torch.Tensor) and v is not None and v.kind != "param" else a
                        for v, a in zip(node.inputs, r.args(node, env), strict=True)]
                r.run_node(node, args, meta, out=bucket.outs[node.outs[0].id][:n])
                env[node.outs[0].id] = bucket.outs[node.outs[0].id]  # what the next piece was captured reading
            elif g is not None:
                g.replay()
            else:
                r.run_nodes(nodes, env, bucket.meta)
        for vid in self.plan.tail_reads:  # the tail reads the last piece's rows: only the real ones
            if env[vid].shape[:1] == (b,):
                env[vid] = env[vid][:n]
        r.run_nodes(self.plan.tail, env, meta)
        return env[r.graph.outputs[r.graph.result].id].float()
