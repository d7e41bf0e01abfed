"""The CUDA backend: torch tensors own device memory, cuBLAS runs the GEMMs, the DSL's Triton kernels the rest.

Given device="cpu" the same code runs on CPU tensors with the kernels under Triton's interpreter: far too slow to
serve, but it lets CI run tiny models end to end through every kernel.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from backends.base import Backend, MemoryReport, kv_cache_quant
from backends.cuda import decode_table, eager, weights
from backends.cuda.graphs import DecodeGraphs
from backends.cuda.kv_tensors import layer_caches
from backends.cuda.piecewise import PiecewiseGraphs
from backends.cuda.runner import Runner
from backends.cuda.runtime import torch
from backends.cuda.step_arena import StepArena
from backends.cuda.step_graphs import StepGraphs
from backends.cuda.step_meta import StepMeta, step_table
from backends.cuda.synthetic import random_params
from backends.cuda.warm_batches import (
    one_sequence,
    warm_up_attention,
    warm_up_eager_decode,
    warm_up_eager_prefill,
    warm_up_eager_steps,
    warm_up_graph_prefill,
)
from core.batch import Batch
from core.kv_layout import KVLayout
from ir.fusion import Fusions, concat_parts, fuse
from ir.kv_groups import kv_layout
from ir.loader import LoadedModel
from ir.sharding import ShardedWeights, shard
from ir.weight_formats import FORMATS
from kernels_src import kv_int8

log = logging.getLogger(__name__)

DEFAULT_KV_FRACTION = 0.9  # of the memory free after loading and a warm-up step
PIECEWISE_MAX_TOKENS = 512
WHOLE_STEPS_ENV = "LLM_ENGINE_WHOLE_STEPS"  # "0": steps with prefill tokens in pieces, not as whole CUDA graphs


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


class CUDABackend(Backend):
    name = "cuda"
    chains_steps = True

    def __init__(self, model: LoadedModel, dtype: str | None = None, quantized: bool | None = None,
                 device: str | torch.device | None = None, cuda_graph: bool = True, params: dict | None = None,
                 progress: bool = True, fusions: Fusions | None = None, rank: int = 0, world: int = 1,
                 kv_cache_dtype: str = "auto", random_weights: int | None = None):
        """`rank` of `world`: this process runs that rank's graph (ir.sharding) in a torch.distributed group already
        joined (backends.cuda.tensor_parallel starts them); `mirror`, when set, is told each call that runs it.
        `kv_cache_dtype`: "auto" (the activations' dtype), "int8" (kernels_src.kv_int8's codes and scales) or "fp8"
        (kernels_src.kv_fp8's e4m3 bytes and scales). `random_weights`: a seed; the rank's parameters are then made
        on the device (backends.cuda.synthetic: a model with no file), not read from model.weights."""
        self.kv_quant = kv_cache_quant(kv_cache_dtype, "cuda")  # None, "int8" or "fp8"
        self.model = model
        self.rank, self.world = rank, world
        self.rank_graph = shard(model.graph, rank, world)
        self._kv_layout = kv_layout(self.rank_graph)  # the rank's heads: its KV cache is sized per rank
        # Sampled tokens stay on rank 0; the workers take each step's token ids from its batch instead.
        self.chains_steps = world == 1
        self.mirror = None
        self.workers = None  # rank 0's view of the other ranks (backends.cuda.tensor_parallel.Workers)
        if device is None and not torch.cuda.is_available():
            raise NotImplementedError("the CUDA backend needs an NVIDIA GPU that torch can use (torch.cuda."
                                      "is_available() is False); use --backend mlx")
        if importlib.util.find_spec("triton") is None:
            raise NotImplementedError("the CUDA backend needs triton (pip install triton); use --backend mlx")
        wide = sorted({(s.key_dim, s.value_dim) for s in super().kv_layout().shapes if s.value_dim > s.key_dim})
        if wide:
            raise NotImplementedError(f"{model.arch.name}: values wider than keys {wide} are not on the CUDA backend; "
                                      "use --backend mlx")
        if self.kv_quant:
            self._check_quant_layout(model.arch.name)
        self.device = torch.device(device or "cuda")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # as vLLM's server: a burst of 64 prompts of 128 tokens in one step (an H200, 8B F16, 64 streams: ITL p99
            # 8.1 ms against 14.8 with the base's 2,048; docs/BENCHMARKS.md 2026-12-04). CPU tensors keep 2,048.
            self.default_step_tokens = 8192
        self.dtype = dtype or self.default_dtype(model, self.device)
        self.quantized = True if quantized is None else quantized
        if params is None and random_weights is not None:
            params = random_params(self.rank_graph, self.dtype, self.device, random_weights)
        if params is None:
            stored = ShardedWeights(self.rank_graph, model.weights) if world > 1 else model.weights
            params, fallbacks = weights.to_device(self.rank_graph, stored, self.dtype, self.device, self.quantized,
                                                  progress)
            for reason, count in fallbacks.items():
                log.warning("%d tensor(s) dequantized to %s at load: %s", count, self.dtype, reason)
        # The fusion pass decides what runs fused, by the formats the weights now have on the device.
        self.formats = {name: weights.format_of(p) for name, p in params.items()}
        self.graph = fuse(self.rank_graph, self.formats, fusions or Fusions())
        self.params = concat_parts(self.graph, params, weights.concat)
        del params
        self.runner = Runner(self.graph, self.params, weights.DTYPES[self.dtype], self.device)
        self.runner.decode = decode_table.for_cache(self.kv_quant)  # the fp8 cache's split-K settings differ
        # An embedding model never decodes (its requests are prefills): no decode graphs to capture.
        self.use_graphs = cuda_graph and self.device.type == "cuda" and not model.config.pooled
        if not self.use_graphs and self.device.type == "cuda" and eager.DEFAULT:
            eager.use_eager_fusions(self.runner)  # host-bound steps: fewer launches (backends/cuda/eager.py)
        self.graphs: DecodeGraphs | None = None
        # Steps with prefill tokens, up to this many, replay in pieces (backends.cuda.piecewise); past it a step's GPU
        # time exceeds an eager step's host time (an 8B model: ~13 ms for 512 tokens on an H200), which then hides.
        self.piecewise = self.use_graphs
        self.pieces: PiecewiseGraphs | None = None
        # Such steps as one CUDA graph each (backends.cuda.step_graphs: attention on a grid fixed by a tile map), the
        # pieces kept for what those cannot take. On an H200 a 64-row decode + a 128-token prompt: 8.1 ms against 9.2 in
        # pieces; 64 streams through the server: inter-token p99 31 -> 19 ms, 0.90 -> 0.96 of offline. "0" turns it off.
        # An fp8 cache has no tile-mapped prefill kernel: its steps stay on the pieces.
        self.whole_steps = (self.use_graphs and os.environ.get(WHOLE_STEPS_ENV, "1") == "1"
                            and self.kv_quant != "fp8")
        self.whole: StepGraphs | None = None
        self.max_step_tokens = 2048
        self.kv: list[tuple[torch.Tensor, ...]] = []  # per layer (k, v), (latent,) or int8's / fp8's (k, v, ks, vs)
        self.block_size = 0
        self.max_num_seqs, self.max_model_len = 256, model.config.max_position_embeddings
        self._sampler = None
        self._chain: torch.Tensor | None = None  # the last sample_async's tokens, for Batch.prev_rows
        log.info("cuda backend: %s", self.describe())

    def kv_layout(self) -> KVLayout:
        """The graph's layout, but a value narrower than its key cached at the key's width: the DSL's KV write and
        attention kernels take one head width (runner._attention pads v and cuts the output). A latent layer's one
        cache is read as both (its values are its keys' leading part), so it stays as it is."""
        layout = super().kv_layout()
        if any(s.value_dim < s.key_dim and not s.values_in_keys for s in layout.shapes):
            shapes = tuple(s if s.values_in_keys else s._replace(value_dim=s.key_dim) for s in layout.shapes)
            self._kv_layout = layout = replace(layout, shapes=shapes)
        return layout

    def set_fusions(self, fusions: Fusions) -> None:
        """Runs the graph with other fusions (a benchmark's ablation), on the same parameters: only a change that
        keeps the fused weights (rope_attention, rope_pairs, gated, add_norm) can be made after loading."""
        if self.mirror is not None:
            self.mirror("set_fusions", fusions)
        graph = fuse(self.rank_graph, self.formats, fusions)
        missing = sorted(set(graph.params) - set(self.params))
        if missing:
            raise ValueError(f"{fusions} needs parameters fused away at load ({', '.join(missing[:3])}); pass it to "
                             "CUDABackend instead")
        self.graph, old = graph, self.runner
        self.runner = Runner(graph, self.params, weights.DTYPES[self.dtype], self.device)
        for attr in ("pdl", "attention_pdl", "decode", "dense_gemv", "gemv_prologues", "gemv_max_rows", "dense_gemm",
                     "mmq_variant", "mmq_max_rows", "x_int8_fusion", "fused_reduce", "rope_decode"):
            setattr(self.runner, attr, getattr(old, attr))
        if old.arena is not None:  # its kept values are the old graph's
            self.runner.arena = StepArena(graph)
        if self.kv:
            self.runner.set_cache(self.kv, self.runner._rope_rows)

    @staticmethod
    def default_dtype(model: LoadedModel, device: torch.device) -> str:
        """fp32 on CPU tensors (Triton's interpreter mishandles bf16). On a GPU, bf16 for a model stored in bf16 or
        fp32; fp16 for GGUF and fp16 models, as llama.cpp computes them: bf16's 8-bit mantissa flips SmolLM2's
        first answer token, whose two best logits lie 0.08 apart. A GPTQ/AWQ/compressed-tensors model goes by its
        unquantized tensors (integer groups and FP8 blocks keep their scales in fp32)."""
        if device.type != "cuda":
            return "f32"
        kinds = {t.kind for t in model.weights.values()
                 if getattr(FORMATS.get(t.kind), "family", None) not in ("intgroup", "fp8")}
        return "bf16" if kinds and kinds <= {"BF16", "F32"} else "f16"

    def describe(self) -> str:
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu tensors"
        quant = sorted({p.qtype for p in self.params.values() if isinstance(p, weights.QuantWeight)})
        where += f", rank {self.rank} of {self.world}" if self.world > 1 else ""
        kv = f", {self.kv_quant} KV cache" if self.kv_quant else ""
        return (f"{where}, {self.dtype}, {'weights ' + '/'.join(quant) if quant else 'dense'}, "
                f"CUDA graphs {'on' if self.use_graphs else 'off'}{', whole prefill steps' if self.whole_steps else ''}"
                f"{kv}")

    # -- KV cache -----------------------------------------------------------------------------------
    def set_limits(self, max_num_seqs: int, max_model_len: int, max_step_tokens: int | None = None) -> None:
        """Graphs are captured for decode batches up to max_num_seqs, and in pieces for steps of up to
        max_step_tokens (within PIECEWISE_MAX_TOKENS); rope tables cover max_model_len positions."""
        if self.mirror is not None:
            self.mirror("set_limits", max_num_seqs, max_model_len, max_step_tokens)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        if max_step_tokens is not None:
            self.max_step_tokens = max_step_tokens

    def _check_quant_layout(self, arch: str) -> None:
        """The 8-bit caches take K and V heads (int8: of dims that are multiples of kv_int8.GROUP); MLA's latent is
        refused."""
        for s in self.kv_layout().shapes:
            if s.values_in_keys:
                raise NotImplementedError(f"{arch}: --kv-cache-dtype {self.kv_quant} on the CUDA backend has no latent "
                                          "(MLA) cache yet (mla_decode reads 16-bit latents); use --kv-cache-dtype "
                                          "auto, or --backend mlx (int8)")
            if self.kv_quant == "int8":
                kv_int8.check_head_dim(s.key_dim)

    def kv_bytes_per_block(self, block_size: int, group: int | None = None) -> int:
        if not self.kv_quant:
            return self.kv_bytes(block_size, weights.DTYPES[self.dtype].itemsize, group)
        layout = self.kv_layout()
        groups = range(layout.num_groups) if group is None else (group,)
        shapes = [layout.shapes[i] for g in groups for i in layout.groups[g].layers]
        elements = sum(s.elements for s in shapes)
        if self.kv_quant == "fp8":  # a byte each, an fp32 scale a token and head of K and of V
            return block_size * (elements + sum(2 * s.heads for s in shapes) * 4)
        return block_size * (elements + elements // kv_int8.GROUP * 4)  # a code each, an fp32 scale a group

    def default_kv_bytes(self) -> int:
        return self.kv_budget(DEFAULT_KV_FRACTION) if self.device.type == "cuda" else super().default_kv_bytes()

    def kv_budget(self, fraction: float, max_step_tokens: int = 2048, block_size: int = 16) -> int:
        """`fraction` of the device memory free after the weights and one warm-up step of `max_step_tokens`. Called
        before allocate_kv (the engine sizes the cache with it): the warm-up's scratch cache is dropped."""
        if self.device.type != "cuda":
            return super().kv_budget(fraction, max_step_tokens, block_size)
        self._warm_up(max_step_tokens, block_size)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(free * fraction)
        log.info("KV budget %s: %.2f of %s free (of %s) after weights %s and a %d-token warm-up step",
                 _mib(budget), fraction, _mib(free), _mib(total), _mib(self.memory().weights_bytes), max_step_tokens)
        if budget < self.kv_bytes_per_block(block_size):
            raise MemoryError(f"no GPU memory left for the KV cache: {_mib(free)} free of {_mib(total)} after "
                              f"loading {_mib(self.memory().weights_bytes)} of weights; use a smaller model, "
                              f"a quantized one, or a smaller --max-num-batched-tokens")
        return budget

    def _warm_up(self, tokens: int, block_size: int) -> None:
        """One prefill step of `tokens` tokens into a scratch cache: the activations' peak is then held by torch's
        allocator, so what the device reports free afterwards is what the KV cache may take."""
        blocks = -(-tokens // block_size)
        self.allocate_kv(blocks, block_size, _graphs=False)
        n = min(tokens, self.model.config.vocab_size)
        ids = np.arange(tokens, dtype=np.int32) % n
        positions = (np.arange(tokens) % min(tokens, self.max_model_len)).astype(np.int32)  # within the rope table
        self.forward(one_sequence(ids, positions, np.arange(tokens, dtype=np.int32),
                                  np.arange(blocks, dtype=np.int32)[None], self.kv_layout().num_groups))
        torch.cuda.synchronize(self.device)
        self.kv = []
        self.runner.drop_cache()

    def allocate_kv(self, num_blocks: int | Sequence[int], block_size: int, _graphs: bool = True) -> None:
        if self.mirror is not None:  # the workers capture their graphs as this rank does, collectives in step
            self.mirror("allocate_kv", num_blocks, block_size, _graphs=_graphs)
        # the old cache first, and everything that holds its tensors: a long context's cache allocated again (an
        # ablation's engine) would otherwise need room for both (session 19: 2 x 64 GiB at 16 x 32k tokens)
        self.kv, self.graphs, self.pieces, self.whole = [], None, None, None
        self.runner.drop_cache()
        dt, layout = weights.DTYPES[self.dtype], self.kv_layout()
        pools = [num_blocks] * layout.num_groups if isinstance(num_blocks, int) else list(num_blocks)
        if len(pools) != layout.num_groups:
            raise ValueError(f"{len(pools)} pool sizes for {layout.num_groups} KV groups")
        want = sum(n * self.kv_bytes_per_block(block_size, g) for g, n in enumerate(pools))

        try:
            self.kv = [layer_caches(pools[g], block_size, s, dt, self.kv_quant, self.device)
                       for s, g in zip(layout.shapes, layout.group_of, strict=True)]
        except torch.OutOfMemoryError as e:
            self.kv = []
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # what was allocated before the failure is held for this stream only
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
            raise MemoryError(f"the KV cache ({'/'.join(map(str, pools))} blocks, {_mib(want)}) does not fit: "
                              f"{_mib(free)} free after {_mib(self.memory().weights_bytes)} of weights; lower --mem or "
                              f"--kv-fraction") from e
        self.block_size = block_size
        # No position reaches past the longest context: a 0.9-of-the-GPU cache for a small model holds millions
        # of tokens, and rope tables that long would waste a GiB. Group 0's pool bounds a context (core.kv_layout).
        longest = min(pools[0] * block_size, self.max_model_len)
        self.runner.set_cache(self.kv, longest)
        chain = max(1, self.max_num_seqs)
        if self.use_graphs and _graphs:
            self.graphs = DecodeGraphs(self.runner, -(-longest // block_size), longest, self.max_num_seqs, chain)
            self.graphs.capture_all()
            self._chain = self.graphs.chain
            if self.piecewise:
                self.pieces = PiecewiseGraphs(self.runner, min(PIECEWISE_MAX_TOKENS, self.max_step_tokens))
                self.pieces.capture_all()
                warm_up_attention(self, block_size)
            if self.whole_steps:
                self.whole = StepGraphs(self.runner, self._chain, min(PIECEWISE_MAX_TOKENS, self.max_step_tokens),
                                        self.max_num_seqs, -(-longest // block_size))
                self.whole.capture_all()
            # past the pieces' tokens (all, where they could not be captured) a prefill step launches eagerly
            first = self.pieces.buckets[-1] if self.pieces is not None and self.pieces.available else 0
            if self.device.type == "cuda" and self.max_step_tokens > first:
                torch.cuda.reset_peak_memory_stats(self.device)
                warm_up_eager_steps(self, longest)
                warm_up_graph_prefill(self, longest, first)  # several sequences, every row count and table width
                log.info("eager steps of up to %d tokens warmed up: peak %s allocated", self.max_step_tokens,
                         _mib(torch.cuda.max_memory_allocated(self.device)))
                torch.cuda.empty_cache()  # its activations back to the device: the cache holds no more than a step's
        else:
            self._chain = torch.zeros(chain, dtype=torch.int32, device=self.device)
            if _graphs and self.device.type == "cuda" and not self.model.config.pooled:
                warm_up_eager_decode(self, longest)  # every kernel an eager decode step launches
                warm_up_eager_prefill(self, longest)  # and those of prefill steps (by token count, table width)
                if self.runner.arena is not None:
                    self.runner.arena.clear()  # the last warm-up batch's buffers (a serving batch keeps its own)
                torch.cuda.empty_cache()  # its activations back to the device, as after warm_up_eager_steps

    # -- a step -------------------------------------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        """fp32 logits [len(batch.logits_indices), vocab] on the device (the sampler reads them there)."""
        if self.workers is None:
            return self._forward(batch)
        try:
            return self._forward(batch)
        except RuntimeError as e:  # a collective that lost its peer: say which worker died, if one did
            self.workers.explain(e)
            raise

    def _forward(self, batch: Batch, mirror: bool = True) -> torch.Tensor:
        if not self.kv:
            raise RuntimeError("allocate_kv must be called before forward")
        groups = self.kv_layout().num_groups
        if batch.num_groups != groups:
            raise ValueError(f"this model has {groups} KV groups; the batch has {batch.num_groups}")
        if self.mirror is not None and mirror:
            self.mirror("forward", batch)
        if self.graphs is not None and self.graphs.applies(batch):
            logits = self.graphs(batch)
            if logits is not None:
                return logits
        if self.whole is not None and self.whole.applies(batch):
            logits = self.whole(batch)
            if logits is not None:
                return logits
        dev = self.device
        if batch.is_decode and eager.pads_rows(self.runner):
            batch = eager.padded_rows(batch, self.max_num_seqs)  # the step arena's launches kept as rows change

        def up(a: np.ndarray, dtype=torch.int32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype, non_blocking=True)

        more = tuple((up(s, torch.int64), up(step_table(t)))
                     for s, t in zip(batch.group_slots, batch.group_tables, strict=True))
        meta = StepMeta(up(batch.positions), up(batch.slot_mapping, torch.int64), up(step_table(batch.block_tables)),
                        up(batch.context_lens), up(batch.query_start), batch.is_decode,
                        int(np.diff(batch.query_start).max(initial=0)), int(batch.context_lens.max(initial=1)),
                        more)
        ids = up(batch.token_ids)
        if batch.prev_rows is not None:
            prev = up(batch.prev_rows)
            ids = torch.where(prev >= 0, self._chain[prev.clamp(min=0).long()], ids)
        if self.pieces is not None and self.pieces.applies(batch.num_tokens):
            logits = self.pieces.run(ids, up(batch.logits_indices), meta)
            if logits is not None:
                return logits
        return self.runner.run(ids, up(batch.logits_indices), meta)

    def to_host(self, out: torch.Tensor) -> np.ndarray:
        return out.float().cpu().numpy()

    def sample(self, logits, inputs):
        return self.sample_async(logits, inputs).result()

    def sample_async(self, logits, inputs):
        """Tokens stay on the device for the next step (Batch.prev_rows); the read-back waits for `.result()`."""
        if self._sampler is None:
            from backends.cuda.sampling import TorchSampler

            self._sampler = TorchSampler()
        tokens, pending = self._sampler.launch(logits, inputs)
        if self._chain is not None and len(tokens) <= len(self._chain):
            self._chain[:len(tokens)].copy_(tokens)
        return pending

    def is_fatal(self, error: BaseException) -> bool:
        """A CUDA error that outlives its step (a device-side assert, an illegal address) poisons the context, and
        every later call fails too. Probed rather than read from the message: one small launch and a synchronize.
        Over several ranks any failed step is: a rank may have died, or the ranks' collectives fallen out of step."""
        if self.world > 1 and not isinstance(error, ValueError):
            return True
        if self.device.type != "cuda" or not isinstance(error, RuntimeError):
            return False
        try:
            torch.ones(1, device=self.device).add_(1)
            torch.cuda.synchronize(self.device)
            return False
        except Exception:  # noqa: BLE001  (whatever the probe raises, the device is unusable)
            return True

    def memory(self) -> MemoryReport:
        wbytes = sum(weights.nbytes(p) for p in self.params.values())
        kbytes = sum(t.numel() * t.element_size() for layer in self.kv for t in layer)
        return MemoryReport(wbytes, kbytes, str(self.device))
