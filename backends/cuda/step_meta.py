"""A step's batch as the runner's kernels read it (`StepMeta`), and the decode kernel's grid rules the runner and the
CUDA graphs share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.cuda.runtime import torch
from ir.graph import Node
from kernels_src import paged_attention
from kernels_src.mla_decode import mla_tiles


@dataclass
class StepMeta:
    """One step's batch on the device (the `core.batch` contract) and what the kernels' grids need from the host."""

    positions: torch.Tensor  # [T] int32
    slots: torch.Tensor  # [T] int64, negative: padding, nothing written
    block_tables: torch.Tensor  # [B, M] int32
    context_lens: torch.Tensor  # [B] int32
    query_start: torch.Tensor  # [B + 1] int32
    decode: bool  # every sequence adds one token: the split-K decode kernel
    max_query_len: int
    max_context: int  # fixes the decode kernel's grid (with Runner.max_partitions); longer contexts still work
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # (slots, block_tables) of KV groups 1.. (core.batch)
    # (GQA group, row tile) -> paged_prefill's tile map: the prefill kernel on a grid fixed by the map's capacity (a
    # whole-step CUDA graph's, backends.cuda.step_graphs); None: the grid from max_query_len
    tile_maps: dict[tuple[int, int], torch.Tensor] | None = None

    def kv_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, block tables) of one KV group (core.kv_layout)."""
        return (self.slots, self.block_tables) if group == 0 else self.groups[group - 1]


# An eager step's block tables are padded (with block 0, never read: the kernels stop at each context's length) to a
# multiple of this many blocks, so that their shape, which the step arena's kept attention launches are keyed on
# (backends/cuda/attention.py), changes once every 1,024 tokens rather than whenever the longest sequence takes a
# new block (tests/test_cuda_step_arena.py sees every layer's attention planned again without it), and every table's
# stride is of one integer class (the warm-ups build one width).
TABLE_BUCKET = 64


def step_table(tables: np.ndarray) -> np.ndarray:
    """[B, M] block tables as an eager step uploads them: unused entries (-1) at 0, M rounded up to TABLE_BUCKET."""
    rows, width = tables.shape
    out = np.zeros((rows, -(-max(width, 1) // TABLE_BUCKET) * TABLE_BUCKET), np.int32)
    np.maximum(tables, 0, out=out[:, :width])
    return out


def decode_programs(node: Node) -> int:
    """Decode programs per (sequence, partition): one per KV head, or a latent layer's mla_decode head groups."""
    latent = node.op == "latent_attention"
    return -(-node.inputs[0].shape[1] // mla_tiles(1, 1)["BLOCK_H"]) if latent else node.inputs[1].shape[1]


def partitions_for(max_context: int, partition: int) -> int:
    return paged_attention.num_partitions(max_context, partition)
