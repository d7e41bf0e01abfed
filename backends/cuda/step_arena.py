"""An eager decode step's intermediates in buffers kept from step to step, as a CUDA graph's static buffers are
(issue 13: eager within 1.5x of graphs). torch.empty costs ~7 us of host time on an H200's host, and a Llama layer's
one-row step made seven (its GEMVs' outputs, add_rms_norm's sums, the attention's output); a kept buffer is a dict
lookup.

Each value gets a buffer of its own (by value id), so no two values of a step share one: whatever reads a value
within the step reads what its producer wrote. Across steps, a value's producer overwrites the buffer its previous
step's value lay in, so only values that die inside the step may live here: never the graph's outputs (the logits,
a hidden state the engine keeps) nor a value an output may be a view of or the same tensor as (`keep`). Everything
runs in one stream's order, so the next step's producer writes after this step's readers on the GPU too.

Buffers are kept for one row count: a step of other rows lets go of them all (a server's decode batch changes when
a request joins or leaves; steady decoding repeats it). Up to `max_bytes` in all; past it a value is allocated as
before. `check` (tests): each step fills the buffers with NaN before it runs, so a value read after its producer's
next step began reads NaN, not plausible stale numbers.

With the buffers the same tensors every step, so are most launches' arguments: `memo` keeps them for callers that
check their inputs are last step's objects and launch again without working anything out (a GEMV's or dense GEMM's
plan lookup, its checks; a norm's or gated activation's, `kept_launch`; a view's split; the attention's launches,
the step's own arrays swapped in). On CPU with launches
stubbed (tools/bench_eager_host) an 8-layer batch-1 step's host time went 81 -> 30 us a layer."""

from __future__ import annotations

from backends.cuda.runtime import torch
from ir.graph import Graph

MAX_BYTES = 64 * 2**20  # an 8B model's 16-row step keeps ~35 MB (every layer's values at once); past ~32 rows a
# step's later layers allocate (the GPU time of such steps hides more of the host's), and a prefill after them finds
# the memory the KV budget left free (its fraction's rest) short by no more than this
# ops whose result may be (a view of) an input: a value they make that must be kept makes their input kept too
ALIASING = frozenset({"slice", "reshape", "rope", "rope_pair", "all_reduce", "all_gather"})


def kept_values(graph: Graph) -> frozenset[int]:
    """The ids of the graph's outputs and of every value one of them may share memory with."""
    keep = {v.id for v in graph.outputs.values()}
    for node in reversed(graph.nodes):
        if node.op in ALIASING and any(v.id in keep for v in node.outs):
            keep.update(v.id for v in node.inputs if v is not None)
    return frozenset(keep)


class StepArena:
    def __init__(self, graph: Graph, max_bytes: int = MAX_BYTES, check: bool = False):
        self.keep = kept_values(graph)
        self.max_bytes, self.check = max_bytes, check
        self.rows = -1  # the row count its buffers are for
        self.settings: tuple = ()
        self.bytes = 0
        self._buffers: dict[int, torch.Tensor] = {}
        # A launch's arguments kept by its callers (gemv_fusion.run, Runner.linear, run_nodes' views), valid while the
        # buffers are: a step whose inputs are the same tensors as last step's (kept buffers, their views, the
        # parameters) launches the same arguments again, or takes the same views, without working them out. Keys:
        # a linear's value id (small), id() of a chain, view or attention node (addresses: never that small), tuples
        self.memo: dict = {}

    def begin(self, rows: int, settings: tuple = ()) -> None:
        """A step of `rows` rows starts; `settings`: the runner's that its launches depend on (the kernels' target,
        PDL, ...): the memos are kept while they stay the same."""
        if rows != self.rows:
            self._buffers, self.memo, self.rows, self.bytes = {}, {}, rows, 0
        if settings != self.settings:
            self.memo, self.settings = {}, settings
        if self.check:
            for b in self._buffers.values():
                if b.is_floating_point():
                    b.fill_(float("nan"))

    def take(self, vid: int, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """Value `vid`'s buffer of `shape`, like's dtype and device (uninitialised: its last step's numbers)."""
        b = self._buffers.get(vid)
        if b is not None and b.shape == shape and b.dtype == like.dtype:
            return b
        b = like.new_empty(shape)
        if vid in self.keep:
            return b
        size = b.numel() * b.element_size()
        if vid not in self._buffers and self.bytes + size <= self.max_bytes:
            self._buffers[vid], self.bytes = b, self.bytes + size
        return b

    def holds(self, vid: int, t) -> bool:
        """Whether `t` is value `vid`'s kept buffer (not a kept value's, nor one past max_bytes): a launch that
        writes it may be kept in memo (its result the same tensor every step)."""
        return self._buffers.get(vid) is t

    def kept_launch(self, node, ins: tuple, run):
        """`node`'s launch into its outputs' kept buffers: launched again where its inputs `ins` are last step's
        tensors (kept buffers, their views, parameters), else `run(buffers)` -> (result, (launch, its arguments)),
        kept in memo while every output is a kept buffer (Runner's add_rms_norm and gated activation)."""
        key = ("kept", node.outs[0].id)
        last = self.memo.get(key)
        if last is not None and all(a is b for a, b in zip(last[0], ins, strict=True)):
            last[1](*last[2])
            return last[3]
        outs = [self.take(v.id, ins[0].shape, ins[0]) for v in node.outs]
        result, (launch, args) = run(outs)
        if all(self.holds(v.id, t) for v, t in zip(node.outs, outs, strict=True)):
            self.memo[key] = (ins, launch, args, result)
        return result

    def clear(self) -> None:
        """Let go of every buffer (e.g. after the warm-up's steps of every row count)."""
        self.begin(-1)
