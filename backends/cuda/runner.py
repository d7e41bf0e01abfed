"""Runs an IR graph on torch tensors: GEMMs through torch (cuBLAS), the rest through the DSL's kernels.

Every op reads its inputs and the step's metadata (`StepMeta`) from device tensors only, never from the host, so
one decode step can be captured as a CUDA graph and replayed (see `backends.cuda.graphs`).
"""

from __future__ import annotations

import numpy as np

from backends.cuda import (
    attention,
    decode_scratch,
    distributed,
    gemv_fusion,
    linears,
    node_steps,
    torch_ops,
    x_int8_fusion,
)
from backends.cuda.decode_table import DecodeTable
from backends.cuda.fp8_linear import dequantize as fp8_dequantize
from backends.cuda.runtime import kernel_target, torch
from backends.cuda.step_arena import StepArena
from backends.cuda.step_meta import StepMeta, decode_programs
from backends.cuda.weights import Param, QuantWeight
from ir.graph import Graph, Node, Value
from ir.kv_groups import kv_layout
from ir.rope import RopeSpec, cos_sin, long_after
from kernels_src import (
    activations,
    moe,
    moe_route,
    rms_norm,
    rope,
)
from kernels_src.gguf_mmq import MAX_ROWS as MMQ_MAX_ROWS


class Runner:
    def __init__(self, graph: Graph, params: dict[str, Param], dtype, device: torch.device):
        """`graph` is ir.fusion's output: its fused ops are this runner's fused kernels."""
        self.graph, self.params, self.dtype, self.device = graph, params, dtype, device
        uses = graph.uses()
        outputs = {v.id for v in graph.outputs.values()}
        # values one node reads and nothing else: a rope may rotate them in place
        self._sole = {vid for vid, readers in uses.items() if len(readers) == 1 and vid not in outputs}
        # run_nodes lets go of a value after its last reader: an eager step held every layer's activations to its
        # end (an 8B model's 8,192-token step: ~1 GB a layer, tens of GB, then kept by torch's caching allocator)
        # (node_steps.Steps holds that plan, graph.last_reads, with run_nodes' walk through each list of nodes)
        self.target = kernel_target(device)
        self.kv: list[tuple[torch.Tensor, ...]] = []  # per layer (k, v), or (latent,)
        self._rope: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_rows = 0  # positions in each table (a longrope table has twice as many rows)
        self._step_rows: dict[RopeSpec, torch.Tensor] = {}  # this step's rope_rows
        self._rows: dict[tuple[int, int], torch.Tensor] = {}
        self.pdl: bool | None = None  # kernels as programmatic dependent launches (None: wherever the target can)
        self.attention_pdl: bool | None = None  # the attention kernels' (None: as self.pdl)
        self.decode = DecodeTable()  # split-K partitions, grid cap and tile by batch size (a benchmark may swap it)
        # split-K decode partials combined by the decode's last partition, no reduce kernel (kernels_src/
        # decode_combine.py; None: where the target has atomics when LLM_ENGINE_FUSED_REDUCE=1)
        self.fused_reduce: bool | None = None
        self._counters: list[torch.Tensor] = []  # its counters, smallest first (decode_counters)
        # a decode step's rope and KV write done by the decode kernel, one launch fewer a layer (kernels_src/
        # paged_decode_rope.py; None: on where the target takes it, unless LLM_ENGINE_ROPE_DECODE=0)
        self.rope_decode: bool | None = None
        self.decode_scratch = decode_scratch.DecodeScratch(device)  # its partials, kept between layers and steps
        self.attention_layers: tuple = (None, None, {})  # attention.layer's (kv, rope tables, per node) lookups
        self.decode_settings: tuple = (None, None, None, {})  # attention.decode_settings' by rows, and their inputs
        # Dense fp16/bf16 linears of up to `gemv_max_rows` rows through kernels_src/dense_gemv instead of cuBLAS, with
        # the norm or gated activation before them (and a residual add after) fused in where `gemv_prologues`
        # (backends/cuda/gemv_fusion.py). Measured on an H200 (docs/BENCHMARKS.md, 2026-12-03): one-row steps gain
        # (Llama-3-8B batch 1 219 -> 250 tok/s, phi-3-mini 341 -> 422), four rows lose 3.5% on Llama's shapes, and
        # the fused prologues lose at every size; so one row, no prologues, on a GPU (CPU tensors keep F.linear).
        self.dense_gemv = device.type == "cuda"
        self.gemv_prologues = False
        self.gemv_max_rows = 1
        # Dense linears of 9+ rows through kernels_src/dense_gemm where its table (TUNED, LLM_ENGINE_DENSE_GEMM_TUNED)
        # lists the (row bucket, N, K): a GPU sweep saw it beat cuBLAS there (tools/sweep_dense_gemm); else cuBLAS.
        self.dense_gemm = device.type == "cuda"
        # Q4_K / Q6_K linears of MMQ_MIN_ROWS..mmq_max_rows rows through kernels_src/gguf_mmq, in mmq_variant (None:
        # MMQ_TUNED's choice per problem, else MMQ_VARIANT); a benchmark may change both (tools/bench_gguf --mmq).
        self.mmq_variant: str | None = None
        self.mmq_max_rows = MMQ_MAX_ROWS
        self._gemv_chains = gemv_fusion.plan(graph, params)
        self._steps = node_steps.Steps(graph.last_reads(), self._gemv_chains, uses)
        # add_rms_norm / gated also writing x's int8 form for the GGUF int8 GEMVs after them, no quantize_x launch
        # (backends/cuda/x_int8_fusion.py; None: its DEFAULT, on unless LLM_ENGINE_X_INT8_FUSION=0)
        self.x_int8_fusion: bool | None = None
        self.x_int8_plan = x_int8_fusion.plan(graph, params)
        self.kv_heads = max((decode_programs(n) for n in graph.attention_nodes()), default=1)
        self.group_of = kv_layout(graph).group_of  # layer -> its KV group: which tables its attention reads
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        # An eager decode step's intermediates in buffers kept between steps (backends/cuda/step_arena.py; None: each
        # allocated, as under graphs, whose captures hold static buffers of their own); step_arena: this step's
        self.arena: StepArena | None = None
        self.step_arena: StepArena | None = None

    def drop_cache(self) -> None:
        """Let go of the KV cache's tensors: the layers' lookup of them (attention.layer) too, which is otherwise
        renewed only by the next step's first attention."""
        self.kv = []
        self.attention_layers = (None, None, {})

    def set_cache(self, kv: list[tuple[torch.Tensor, ...]], max_positions: int) -> None:
        """Caches per layer [num_blocks, block_size, Hkv, D] (k and v, or a latent's one); rope tables for positions
        below max_positions. A longrope table holds the short rows, then the long ones: a token of a long sequence
        reads row max_positions + position (rope_rows), so the kernels need not know."""
        self.kv = kv
        pos = np.arange(max_positions)
        self._rope = {}
        self._rope_rows = max_positions
        for spec in self.graph.rope_specs():
            if long_after(spec) is None:
                cos, sin = cos_sin(spec, pos)
            else:
                lens = np.concatenate([np.zeros_like(pos), np.full_like(pos, np.iinfo(np.int32).max)])
                cos, sin = cos_sin(spec, np.concatenate([pos, pos]), lens)
            self._rope[spec] = (torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device))

    def rope_rows(self, spec: RopeSpec, meta: StepMeta) -> torch.Tensor:
        """Each token's row of `spec`'s table: its position, in the long half for a longrope token whose sequence is
        longer than the limit (ir.rope.long_after). Device ops only, so a decode step stays capturable."""
        limit = long_after(spec)
        if limit is None:
            return meta.positions
        if spec not in self._step_rows:
            t = meta.positions.shape[0]
            seq = torch.searchsorted(meta.query_start[1:], torch.arange(t, dtype=torch.int32, device=self.device),
                                     right=True)
            long = meta.context_lens[seq.clamp(max=meta.context_lens.shape[0] - 1)] > limit
            self._step_rows[spec] = meta.positions + long.to(torch.int32) * self._rope_rows
        return self._step_rows[spec]

    def decode_partition(self, rows: int) -> int:
        return self.decode.partition(rows * self.kv_heads)

    def max_partitions(self, rows: int) -> int:
        return self.decode.grid_cap(rows * self.kv_heads, self.sms)

    def decode_counters(self, n: int) -> torch.Tensor:
        """At least n int32 counters for the split-K decode whose last partition combines (kernels_src/
        decode_combine.py): zeroed once, left at 0 by every launch, so every layer and graph shares them (they run
        one after another). The decode graphs reserve their largest batch's before capturing; growing inside a
        capture would record a memset into the graph, so it is refused (that graph's steps run eagerly). A larger
        eager batch gets a larger buffer; the old ones stay allocated, as graphs captured on them replay them."""
        if not self._counters or self._counters[-1].numel() < n:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"decode counters: {n} needed inside a CUDA graph capture; reserve them before")
            self._counters.append(torch.zeros(n, dtype=torch.int32, device=self.device))
        return self._counters[-1]

    @property
    def _attend_pdl(self) -> bool | None:
        return self.pdl if self.attention_pdl is None else self.attention_pdl

    # -- the graph ----------------------------------------------------------------------------------
    def run(self, token_ids: torch.Tensor, logits_indices: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """fp32 logits [len(logits_indices), vocab]."""
        env = self.input_env(token_ids, logits_indices, meta.positions)
        self._step_rows = {}
        arena = self.step_arena = self.arena if meta.decode else None
        if arena is not None:
            arena.begin(meta.positions.shape[0], (self.target, self.pdl, self.attention_pdl, self.fused_reduce,
                                                  self.decode, self.dense_gemv, self.dense_gemm, self.gemv_max_rows,
                                                  self.gemv_prologues, self.rope_decode))
        try:
            self.run_nodes(self.graph.nodes, env, meta)
        finally:
            self.step_arena = None  # run_nodes' other callers (piecewise pieces) allocate
        return env[self.graph.outputs[self.graph.result].id].float()

    def input_env(self, token_ids, logits_indices, positions) -> dict:
        """The graph's inputs by value id: the start of the environment `run_nodes` fills."""
        given = {"token_ids": token_ids, "logits_indices": logits_indices, "positions": positions}
        return {v.id: given.get(name) for name, v in self.graph.inputs.items()}

    def args(self, node: Node, env: dict) -> list:
        return [None if v is None else self.params[v.name] if v.kind == "param" else env[v.id] for v in node.inputs]

    def run_nodes(self, nodes, env: dict, meta: StepMeta) -> None:
        """Run `nodes` in order, reading and writing their values in `env` (backends.cuda.piecewise runs a graph's
        pieces through this, with attention between them). With dense_gemv on, a node and the linear after it may
        run as one GEMV (gemv_fusion.run); a view (slice, reshape) is taken here, not through run_node."""
        # a chain's x has the step's rows: past the GEMV's, none is tried (gemv_fusion.run checks each x it runs)
        chains = self.dense_gemv and self.gemv_prologues and meta.positions.shape[0] <= self.gemv_max_rows
        steps, params, run_node = self._steps(nodes), self.params, self.run_node
        memo = None if self.step_arena is None else self.step_arena.memo  # views of kept buffers, kept
        i, n = 0, len(steps)
        while i < n:
            node, ins, outs, drops, view, chain = steps[i]
            if chain is not None and chains and (ran := gemv_fusion.run(chain[0], env, self)):
                drops = chain[1]
            elif view is not None:  # a view, or a run of them (node_steps): `ran` nodes, their drops merged
                fn, ran, outs, drops = view
                src = env[ins[0][1]]
                if memo is None:
                    got = fn(src)
                elif (last := memo.get(id(view))) is not None and last[0] is src:  # the same tensor: its views
                    got = last[1]
                else:
                    got = fn(src)
                    memo[id(view)] = (src, got)
                for vid, t in zip(outs, got, strict=True):
                    env[vid] = t
            else:
                ran = 1
                out = run_node(node, [env[k] if how else params[k] if how is not None else None for how, k in ins],
                               meta)
                if len(outs) == 1:
                    env[outs[0]] = out
                else:
                    for vid, t in zip(outs, out, strict=True):
                        env[vid] = t
            for vid in drops:
                env.pop(vid, None)
            i += ran

    def run_node(self, node: Node, args: list, meta: StepMeta, out=None):
        """One node's result; an attention writes it into `out` [T, Hq, Dv] when given."""
        op = node.op
        if op == "linear":  # the commonest ops first: an eager step dispatches ~17 nodes a layer
            return self.linear(args[0], args[1], args[2] if len(args) > 2 else None, node.outs[0].id)
        if op == "slice" or op == "reshape":  # (run_nodes takes them itself: node_steps.view)
            return node_steps.view(node)(args[0])
        if op == "add_rms_norm" or op == "gated":  # x_int8_fusion's plan holds such nodes only
            if id(node) in self.x_int8_plan and (fused := x_int8_fusion.produce(self, node, args)) is not None:
                return fused
            if op == "add_rms_norm":
                return self._add_rms_norm(node, args)
            arena = self.step_arena  # an eager decode step's: the result into its kept buffer
            if arena is None:
                return activations.gated_act(args[0], args[1], node.attrs["act"], target=self.target, pdl=self.pdl)
            return arena.kept_launch(node, args[:2], lambda outs: activations.gated_act_launched(
                args[0], args[1], node.attrs["act"], out=outs[0], target=self.target, pdl=self.pdl))
        if op in ("attention", "rope_attention"):
            return _into(out, attention.attention(self, node, args, meta))
        if op == "latent_attention":
            return _into(out, attention.latent_attention(self, node, args, meta))
        if op in ("rope", "rope_pair"):
            return self._rope_op(node, args, meta)
        return self._eval(node, args)

    def _own(self, value: Value, t: torch.Tensor) -> torch.Tensor:
        """`t` itself where this node is its only reader (a kernel may write it in place), else a copy."""
        return t if value.id in self._sole else t.clone()

    def _rope_op(self, node: Node, args, meta: StepMeta):
        spec = node.attrs["spec"]
        cos, sin = self._rope[spec]
        pair = node.op == "rope_pair"
        ts = [self._own(v, t) for v, t in zip(node.inputs[:1 + pair], args[:1 + pair], strict=True)]
        rope.rope(ts[0], ts[1] if pair else None, self.rope_rows(spec, meta), cos, sin,
                  interleaved=spec.style != "neox", target=self.target, pdl=self.pdl)
        return tuple(ts) if pair else ts[0]

    def _add_rms_norm(self, node: Node, args):
        x, r, w = args
        offset = node.attrs["offset"]
        if offset not in (0.0, 1.0):  # the kernel knows w and 1 + w only
            s = x + r
            return s, torch_ops.rms_norm(s, w, node.attrs["eps"], offset)
        arena = self.step_arena
        if arena is None:
            return rms_norm.add_rms_norm(x, r, w, node.attrs["eps"], offset=offset == 1.0, target=self.target,
                                         pdl=self.pdl)
        # an eager decode step's: the sum and the norm into their kept buffers
        return arena.kept_launch(node, (x, r, w), lambda outs: rms_norm.add_rms_norm_launched(
            x, r, w, node.attrs["eps"], offset=offset == 1.0, sum_out=outs[0], out=outs[1], target=self.target,
            pdl=self.pdl))

    # -- single ops ---------------------------------------------------------------------------------
    def linear(self, x, w: Param, b=None, vid: int | None = None):
        """x @ w.T (+ b); `vid`: the result's value id, for the step's kept buffer (step_arena) where it has one."""
        return linears.linear(self, x, w, b, vid)

    def _moe_experts(self, x, weights, ids, w_gate, w_up, w_down, *, act: str):
        """The DSL's fused MoE (kernels_src/moe.py): a GEMV a slot at small batches, else grouped by expert on the
        device; grids fixed by the slot count, whatever the routing, so capturable; each stack dense or GGUF blocks
        (a QuantWeight passes as moe_gguf's stack)."""
        return moe.moe_experts(x, weights, ids, w_gate, w_up, w_down, act, target=self.target, pdl=self.pdl)

    def _row_ids(self, r0: int, r1: int) -> torch.Tensor:
        if (r0, r1) not in self._rows:
            self._rows[(r0, r1)] = torch.arange(r0, r1, dtype=torch.int32, device=self.device)
        return self._rows[(r0, r1)]

    def embedding(self, table: Param, ids, vocab_start: int | None = None):
        if vocab_start is not None:  # a vocab-parallel shard: its rows, zeros for the ids of other ranks
            local = ids - vocab_start
            inside = (local >= 0) & (local < table.shape[0])
            rows = self.embedding(table, torch.where(inside, local, torch.zeros_like(local)))
            return rows * inside.unsqueeze(-1).to(rows.dtype)
        if isinstance(table, QuantWeight) and table.scales is not None:  # FP8 rows
            return fp8_dequantize(table.data.index_select(0, ids), table.scales.index_select(0, ids), self.dtype)
        if isinstance(table, QuantWeight):
            from kernels_src.dequantize import dequantize_rows

            return dequantize_rows(table.data, ids, table.qtype, table.shape[1], dtype=self.dtype, target=self.target,
                                   pdl=self.pdl)
        return table.index_select(0, ids)

    def _eval(self, node: Node, args: list):
        a, op = node.attrs, node.op
        if op == "embedding":
            return self.embedding(args[0], args[1], a.get("vocab_start"))
        if op == "all_reduce":
            return distributed.all_reduce(args[0])
        if op == "all_gather":
            return distributed.all_gather(args[0], a["world"])
        if op == "rms_norm":
            x, offset = args[0], a.get("offset", 0.0)
            if offset not in (0.0, 1.0):  # the kernel knows w and 1 + w only
                return torch_ops.rms_norm(x, args[1], a["eps"], offset)
            return rms_norm.rms_norm(x.reshape(-1, x.shape[-1]), args[1], a["eps"], offset=offset == 1.0,
                                     target=self.target, pdl=self.pdl).reshape(x.shape)
        if op == "layer_norm":
            return torch_ops.layer_norm(args[0], args[1], args[2] if len(args) > 2 else None, a["eps"])
        if op in ("silu", "gelu", "gelu_tanh"):
            return torch_ops.act(op, args[0])
        if op == "sigmoid":
            return torch.sigmoid(args[0])
        if op == "concat":
            x, y = args
            lead = torch.broadcast_shapes(x.shape[:-1], y.shape[:-1])
            return torch.cat([x.expand(*lead, x.shape[-1]), y.expand(*lead, y.shape[-1])], dim=-1)
        if op == "moe_route":  # one DSL launch where the router fits its tile, else torch's dozen ops
            logits = args[0]
            if moe_route.supports(logits.shape[-1], a["top_k"], a.get("n_group", 1)) and logits.stride(-1) == 1:
                return moe_route.moe_route(*args, **a, target=self.target, pdl=self.pdl)
            return torch_ops.moe_route(*args, **a)
        if op == "moe_experts":
            return self._moe_experts(*args, **a)
        if op == "softcap":
            return a["cap"] * torch.tanh(args[0] / a["cap"])
        if op == "scale":
            return args[0] * a["factor"]
        if op == "add":
            return args[0] + args[1]
        if op == "mul":
            return args[0] * args[1]
        if op == "head_linear":  # per head x[:, h] @ w[h].T, one batched GEMM
            return torch.bmm(args[0].transpose(0, 1), args[1].transpose(1, 2)).transpose(0, 1)
        if op == "gather_rows":
            return args[0].index_select(0, args[1])
        raise NotImplementedError(f"the CUDA backend has no lowering for IR op {op!r}")


def _into(out, result):
    """`result`, copied into `out` when given (a static buffer a piecewise graph reads)."""
    return result if out is None else out.copy_(result)
