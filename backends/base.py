"""The interface every backend implements; the engine drives it without knowing which one it is."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ir.batch import Batch
from ir.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class MemoryReport:
    weights_bytes: int
    kv_bytes: int
    device: str  # e.g. "cpu", "metal", "cuda:0"

    def line(self) -> str:
        return (f"{self.device}: weights {self.weights_bytes / 2**20:.0f} MiB, "
                f"KV cache {self.kv_bytes / 2**20:.0f} MiB")


class Backend(ABC):
    name: str
    model: LoadedModel

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V, all layers, for one block of `block_size` tokens."""

    @abstractmethod
    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocate the paged cache; the engine owns which block belongs to whom."""

    @abstractmethod
    def forward(self, batch: Batch) -> np.ndarray:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab]."""

    @abstractmethod
    def memory(self) -> MemoryReport: ...

    def default_kv_bytes(self) -> int:
        """KV budget when the user gives none."""
        return 512 * 2**20


def create_backend(name: str, model: LoadedModel, **options) -> Backend:
    """`name` is "mlx", "cuda" or "auto" (cuda when a usable NVIDIA GPU is present, else mlx)."""
    if name == "auto":
        name = "cuda" if _cuda_usable() else "mlx"
        if name == "cuda" and not _cuda_built():
            log.warning("an NVIDIA GPU is usable but the CUDA backend is not built yet; using mlx")
            name = "mlx"
    if name == "mlx":
        from backends.mlx.backend import MLXBackend
        return MLXBackend(model, **options)
    if name == "cuda":
        raise NotImplementedError("the CUDA backend is not built yet; use --backend mlx")
    raise ValueError(f"unknown backend {name!r} (choose auto, mlx or cuda)")


def _cuda_built() -> bool:
    import importlib.util
    return importlib.util.find_spec("backends.cuda.backend") is not None


def _cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
