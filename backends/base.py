"""The interface every backend implements; the engine drives it without knowing which one it is."""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from core.batch import Batch
from core.kv_layout import KVLayout
from ir.kv_groups import kv_layout
from ir.loader import LoadedModel

log = logging.getLogger(__name__)
IDLE_CHECK_S = 0.25  # an idle engine notices a dead tensor-parallel worker within this (and /health says 503)


@dataclass
class MemoryReport:
    weights_bytes: int
    kv_bytes: int
    device: str  # e.g. "cpu", "metal", "cuda:0"

    def line(self) -> str:
        return (f"{self.device}: weights {self.weights_bytes / 2**20:.0f} MiB, "
                f"KV cache {self.kv_bytes / 2**20:.0f} MiB")


class Sampled:
    """Tokens already on the host: what `sample_async` gives where sampling is not overlapped."""

    __slots__ = ("results",)

    def __init__(self, results: list):
        self.results = results

    def result(self) -> list:
        return self.results


class Backend(ABC):
    name: str
    model: LoadedModel
    # Whether forward takes Batch.prev_rows: input tokens that the previous sample_async left on the device, so
    # the engine can launch a step before reading the last one's tokens back.
    chains_steps: bool = False
    # Rows a step computes for about the cost of its weight read: the decode-step budget's default floor
    # (frontend/engine/scheduler.py's cost model); 0, the budget off unless asked for, until a backend has measured
    # its device's. A CPU has none: every row costs compute (2-core x86, SmolLM2-135M on MLX: a decode step's fixed
    # part ~36 ms, a prefill row ~3.3 ms), and spreading prompts halved 16 streams' throughput (0.96 -> 0.53 of the
    # offline engine; docs/BENCHMARKS.md, 2026-12-03 evening). An H200's is near 128 (a 128-token step in pieces costs
    # 1.56x a decode graph step, 512 tokens 2.85x: 2026-12-01 late night), not the default until a serving run there
    # weighs its throughput against the ITL tail (spreading prompts makes more steps run in pieces); an Apple GPU's
    # near 32 by its FLOPs over bandwidth (not measured).
    step_knee_tokens: int = 0
    # Tokens one step computes at most unless --max-num-batched-tokens says otherwise.
    default_step_tokens: int = 2048
    # Prompt tokens waiting beside decoding streams that make the scheduler prefill them first, decodes paused
    # (frontend/engine/scheduler.py's burst rule); 0: never, every step mixed, until a device's serving run has
    # weighed it.
    prefill_burst_tokens: int = 0

    def set_limits(self, max_num_seqs: int, max_model_len: int, max_step_tokens: int | None = None) -> None:
        """The engine's limits, given before the KV cache is sized: a backend may size per-step buffers by them
        (max_step_tokens: the most tokens one step computes, the scheduler's max_num_batched_tokens)."""
        return None  # the MLX backend sizes everything per step

    def kv_layout(self) -> KVLayout:
        """Which attention layers share a KV pool (core.kv_layout), from the graph (read once)."""
        if getattr(self, "_kv_layout", None) is None:
            self._kv_layout = kv_layout(self.model.graph)
        return self._kv_layout

    def kv_shapes(self) -> list[tuple[int, int, int]]:
        """(kv heads, key dim, value dim) of each attention layer's cache, from the graph."""
        return list(self.kv_layout().shapes)

    def kv_bytes(self, block_size: int, itemsize: int, group: int | None = None) -> int:
        """Bytes of K and V for one block of `block_size` tokens of `itemsize`-byte elements: of every layer, or
        of the layers of one KV group (one block of its pool)."""
        layout = self.kv_layout()
        groups = range(layout.num_groups) if group is None else (group,)
        return sum(layout.group_bytes(g, block_size, itemsize) for g in groups)

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int, group: int | None = None) -> int:
        """Bytes of K and V for one block of `block_size` tokens: all layers, or one KV group's."""

    @abstractmethod
    def allocate_kv(self, num_blocks: int | Sequence[int], block_size: int) -> None:
        """(Re)allocate the paged cache: `num_blocks` blocks in every KV group's pool, or one count per group. The
        engine owns which block belongs to whom."""

    @abstractmethod
    def forward(self, batch: Batch) -> np.ndarray:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab] (an embedding model's graph: its
        final hidden states at those rows, [rows, hidden])."""

    def to_host(self, out) -> np.ndarray:
        """A forward's result as float32 numpy (an embedding model's hidden states are pooled on the host)."""
        return np.asarray(out, np.float32)

    @abstractmethod
    def memory(self) -> MemoryReport: ...

    def default_kv_bytes(self) -> int:
        """KV budget when the user gives none."""
        return 512 * 2**20

    def kv_budget(self, fraction: float, max_step_tokens: int = 2048, block_size: int = 16) -> int:
        """KV budget as `fraction` of the memory free once the model is loaded (here: the host's available RAM)."""
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * fraction)

    def sample(self, logits, inputs) -> list:
        """One token per logits row (see core.sampler); a backend may sample where its logits live."""
        from core.sampler import Sampler

        return Sampler()(np.asarray(logits), inputs)

    def sample_async(self, logits, inputs):
        """Start sampling; `.result()` gives sample's list. A backend with `chains_steps` keeps the tokens on the
        device for the next step's `prev_rows` and reads them back only when asked."""
        return Sampled(self.sample(logits, inputs))

    def idle_check_s(self) -> float | None:
        """How often an idle engine calls check_alive: while this backend has worker processes, else never."""
        workers = getattr(self, "workers", None)  # backends.tp_processes.Workers, over several local processes
        return IDLE_CHECK_S if workers is not None and workers.procs else None

    def check_alive(self) -> None:
        """Raises (WorkerDied) when a worker process this backend steps with has exited; cheap, no collective."""
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.check()

    def on_worker_death(self, callback: Callable[[BaseException], None]) -> None:
        """callback(error) runs on a watch thread when a worker process exits (tp_processes.Workers.watch), after
        the group is aborted; never for a backend without workers."""
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.on_death = callback

    def is_fatal(self, error: BaseException) -> bool:
        """Whether `error`, raised by a step, left this backend unable to run another one: the engine then stops and
        the server reports itself dead (/health 503) instead of failing every later request one by one."""
        return False


CUDA_ONLY = ("device", "cuda_graph", "rendezvous")  # options only the CUDA backend takes
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # --kv-cache-dtype


def kv_cache_quant(kv_cache_dtype: str, backend: str) -> str | None:
    """The 8-bit KV cache `backend` ("mlx" or "cuda") keeps ("int8", "fp8"), None for the activations' dtype; what
    it cannot take is refused, saying what to use instead."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and backend == "mlx":
        raise ValueError("--kv-cache-dtype fp8: MLX has no FP8 type; its 8-bit KV cache is --kv-cache-dtype int8")
    return None if kv_cache_dtype == "auto" else kv_cache_dtype


def create_backend(name: str, model: LoadedModel, **options) -> Backend:
    """`name` is "mlx", "cuda" or "auto" (cuda when a usable NVIDIA GPU is present, else mlx)."""
    if name == "auto":
        name = "cuda" if _cuda_usable() else "mlx"
    if name in ("mlx", "cuda"):  # a KV cache dtype the backend cannot take: refused before anything starts
        kv_cache_quant(options.get("kv_cache_dtype", "auto"), name)
    if name == "mlx":
        from backends.mlx.backend import MLXBackend
        if isinstance(options.get("device"), list | tuple) or options.get("rendezvous") is not None:
            raise NotImplementedError("the MLX backend's tensor parallel is tp=N processes (--tp N), not GPU ids "
                                      "or a torchrun launch")
        ignored = [k for k in CUDA_ONLY if options.pop(k, None) not in (None, True)]
        if ignored:
            log.warning("the mlx backend ignores %s", ", ".join(ignored))
        tp, ring = options.pop("tp", 1), options.pop("ring", None)
        if tp > 1 or ring is not None:
            from backends.mlx import tensor_parallel  # several ranks over MLX's ring: this process is rank 0

            return tensor_parallel.start(model, ring.world if ring else tp, ring=ring, **options)
        return MLXBackend(model, **options)
    if name == "cuda":
        if options.get("tp", 1) > 1:
            raise NotImplementedError("tp=N is the MLX backend's tensor parallel; the CUDA backend's ranks are its "
                                      "devices (--d 0,1)")
        options.pop("tp", None)
        try:
            from backends.cuda.backend import CUDABackend
        except ImportError as e:
            raise NotImplementedError(f"the CUDA backend needs torch and triton ({e}); "
                                      f"install them or use --backend mlx") from e
        device = options.get("device")
        if isinstance(device, list | tuple) or options.get("rendezvous") is not None:
            from backends.cuda import tensor_parallel  # several ranks: this process is rank 0

            options = {k: v for k, v in options.items() if k != "device"}
            return tensor_parallel.start(model, list(device) if isinstance(device, list | tuple) else [device],
                                         **options)
        return CUDABackend(model, **options)
    raise ValueError(f"unknown backend {name!r} (choose auto, mlx or cuda)")


def _cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
