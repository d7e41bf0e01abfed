"""The MLX backend: Metal on Apple Silicon, MLX's CPU build elsewhere."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from backends.base import Backend, MemoryReport, kv_cache_quant
from backends.mlx import fast_blas, kv_quant, weights
from backends.mlx.attention import AttentionMeta
from backends.mlx.decode_step import CompiledDecode
from backends.mlx.lower import GraphRunner, StepContext
from backends.mlx.metal_ops import KernelOps
from backends.mlx.runtime import metal_available, mx
from core.batch import Batch
from ir.fusion import Fusions, concat_parts, fuse
from ir.kv_groups import kv_layout
from ir.loader import LoadedModel
from ir.sharding import ShardedWeights, shard

log = logging.getLogger(__name__)


class MLXBackend(Backend):
    name = "mlx"

    def __init__(self, model: LoadedModel, dtype: str | None = None, quantized: bool | None = None,
                 compile: bool | None = None, kernels: str | None = None, progress: bool = True,
                 fusions: Fusions | None = None, rank: int = 0, world: int = 1, kv_cache_dtype: str = "auto"):
        """`rank` of `world`: this process runs that rank's graph (ir.sharding) in an MLX ring already joined
        (backends.mlx.tensor_parallel starts them); `mirror`, when set, is told each call that runs it.
        `kv_cache_dtype` "int8": the paged cache as 8-bit affine groups (backends.mlx.kv_quant)."""
        self.model = model
        self.kv_int8 = kv_cache_quant(kv_cache_dtype, "mlx") == "int8"
        self.rank, self.world = rank, world
        rank_graph = shard(model.graph, rank, world)
        self._kv_layout = kv_layout(rank_graph)  # the rank's heads: its KV cache is sized per rank
        if self.kv_int8:  # a head dim MLX cannot group is refused before the weights load
            for shape in self._kv_layout.shapes:
                kv_quant.token_bytes(shape, 2)
        self.mirror = None
        self.workers = None  # rank 0's view of the other ranks (backends.tp_processes.Workers)
        self.metal = metal_available()
        # MLX's CPU quantized_matmul and its half-precision GEMMs are several times slower than fp32
        # through OpenBLAS (docs/BENCHMARKS.md), so the CPU default is dense fp32.
        self.dtype = dtype or ("f16" if self.metal else "f32")
        self.quantized = self.metal if quantized is None else quantized
        stored = ShardedWeights(rank_graph, model.weights) if world > 1 else model.weights
        params, fallbacks = weights.convert(rank_graph, stored, self.dtype, self.quantized, progress)
        # The fusion pass decides what runs fused, by the forms the weights now have.
        self.graph = fuse(rank_graph, {name: weights.format_of(p) for name, p in params.items()}, fusions or Fusions())
        self.params = concat_parts(self.graph, params, weights.concat)
        mx.eval([x for v in self.params.values() for x in weights.arrays(v)])
        del params
        for reason, count in fallbacks.items():
            log.warning("%d tensor(s) kept dense instead of MLX-quantized: %s", count, reason)
        self.fallbacks = dict(fallbacks)
        # The DSL's kernels run as Metal kernels on Apple GPUs; "simt-cpu" runs the same lowered programs
        # through the DSL's CPU oracle (slow: for checking the wiring without a Mac).
        kernels = kernels or ("metal" if self.metal else None)
        self.kernels = KernelOps(kernels) if kernels else None
        self.runner = GraphRunner(self.graph, self.params, weights.DTYPES[self.dtype], self.kernels, self.kv_int8)
        # On MLX's CPU build the compiled step measured slower at batch 16 and no faster at batch 1
        # (docs/BENCHMARKS.md), so it is the Metal default only. The CPU oracle reads its inputs on
        # the host, which a traced (compiled) step cannot give it.
        # An embedding model never decodes (its requests are prefills): nothing to compile.
        compile = (self.metal if compile is None else compile) and kernels != "simt-cpu" and not model.config.pooled
        self.decode = CompiledDecode(self.runner, weights.DTYPES[self.dtype]) if compile else None
        self.kv: list[list[mx.array]] = []
        self.block_size = 0
        self.pools: list[int] = []  # blocks of each KV group's pool (core.kv_layout)
        log.info("mlx backend: %s; norms, gated activations and decode attention through %s", self.describe(),
                 f"the DSL's {kernels} kernels" if kernels else "mlx ops (no Metal device)")

    def describe(self) -> str:
        where = "metal" if self.metal else f"cpu, GEMMs via {fast_blas.status}"
        ranks = f", rank {self.rank} of {self.world}" if self.world > 1 else ""
        kv = ", int8 KV cache" if self.kv_int8 else ""
        return f"{where}, {self.dtype}, {'quantized' if self.quantized else 'dense'}{kv}{ranks}"

    def kv_bytes_per_block(self, block_size: int, group: int | None = None) -> int:
        itemsize = weights.DTYPES[self.dtype].size
        if not self.kv_int8:
            return self.kv_bytes(block_size, itemsize, group)
        layout = self.kv_layout()
        layers = range(len(layout.shapes)) if group is None else layout.groups[group].layers
        return block_size * sum(kv_quant.token_bytes(layout.shapes[i], itemsize) for i in layers)

    def allocate_kv(self, num_blocks: int | Sequence[int], block_size: int) -> None:
        dt, layout = weights.DTYPES[self.dtype], self.kv_layout()
        pools = [num_blocks] * layout.num_groups if isinstance(num_blocks, int) else list(num_blocks)
        if len(pools) != layout.num_groups:
            raise ValueError(f"{len(pools)} pool sizes for {layout.num_groups} KV groups")
        if self.mirror is not None:
            self.mirror("allocate_kv", num_blocks, block_size)
        self.kv = []
        for s, g in zip(layout.shapes, layout.group_of, strict=True):
            slots = (pools[g] + 1) * block_size  # the extra block is scratch for padding writes
            dims = [s.key_dim] + ([] if s.values_in_keys else [s.value_dim])  # a latent's values: its keys' start
            if self.kv_int8:
                self.kv.append(kv_quant.flat([kv_quant.allocate(slots, s.heads, d, dt) for d in dims]))
            else:
                self.kv.append([mx.zeros((slots, s.heads, d), dt) for d in dims])
        mx.eval(self.kv)
        self.block_size, self.pools = block_size, pools

    def forward(self, batch: Batch) -> np.ndarray:
        if not self.kv:
            raise RuntimeError("allocate_kv must be called before forward")
        if batch.num_groups != len(self.pools):
            raise ValueError(f"this model has {len(self.pools)} KV groups; the batch has {batch.num_groups}")
        if self.workers is None:
            return self._forward(batch)
        try:
            self.mirror("forward", batch)
            return self._forward(batch)
        except RuntimeError as e:  # a collective that lost its peer: say which worker died, if one did
            self.workers.explain(e)
            raise

    def _forward(self, batch: Batch) -> np.ndarray:
        scratch = [n * self.block_size for n in self.pools]  # each pool's scratch slot
        if self.decode is not None and CompiledDecode.applies(batch):
            logits = self.decode(batch, self.kv, self.block_size, scratch)
            mx.eval(logits, self.kv)
            return np.array(logits, copy=False)
        metas = [AttentionMeta.from_batch(batch, self.block_size, scratch[g], g) for g in range(len(self.pools))]
        ctx = StepContext.for_batch(batch, metas[0], weights.DTYPES[self.dtype])
        if len(metas) > 1:
            ctx.group_metas, ctx.group_of = metas, self.kv_layout().group_of
        inputs = {"token_ids": mx.array(batch.token_ids), "logits_indices": mx.array(batch.logits_indices)}
        out = self.runner.run(inputs, ctx, self.kv)
        logits = out[self.runner.graph.result].astype(mx.float32)
        mx.eval(logits, self.kv)
        return np.array(logits, copy=False)

    def is_fatal(self, error: BaseException) -> bool:
        """Over several ranks any failed step is: a rank may have died, or the ranks' collectives fallen out of
        step."""
        return self.world > 1 and not isinstance(error, ValueError)

    def memory(self) -> MemoryReport:
        wbytes = sum(v.nbytes for v in self.params.values())
        kbytes = sum(a.nbytes for layer in self.kv for a in layer)
        return MemoryReport(wbytes, kbytes, "metal" if self.metal else "cpu")
