"""Random weights made on the device, for a model that has no file (tools/bench_gpu's synthetic shapes): every
element is a hash of (seed, parameter name, its coordinates in the whole parameter), so a tensor-parallel rank makes
its own slice (Param.cut, ir.sharding) on its own device, and the slices of all ranks are those of one model. No rank,
host or disk ever holds the whole model: a Llama-3-70B at TP 2 is 70 GB a GPU, made there in seconds.

Matrices are uniform with standard deviation `std` (bench_gpu's 0.02: finite logits at any depth); vectors (norms,
biases) are ones, as a checkpoint's norms start."""

from __future__ import annotations

import math
import zlib

from backends.cuda import weights
from backends.cuda.runtime import torch
from ir.graph import Graph

M32 = 0xFFFFFFFF
CHUNK = 1 << 25  # elements hashed at once: a few int64 temporaries of 256 MiB on a GPU


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash): a bijection of 32-bit values that spreads every input bit, on int64
    tensors (products wrap; the mask keeps 32 bits)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _key(seed: int, name: str) -> int:
    return zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & M32)


def hashed(key: int, ranges: list[range], device) -> torch.Tensor:
    """Uniform [0, 1) floats (f32) of shape [len(r) for r in ranges], element (i0, i1, ..) from the whole tensor's
    coordinates ranges[0][i0], ranges[1][i1], ..: mix(mix(key + c0) + c1) ..."""
    h = torch.tensor(key, dtype=torch.int64, device=device)
    for d, r in enumerate(ranges):
        coords = torch.arange(r.start, r.stop, dtype=torch.int64, device=device)
        h = _mix(h.unsqueeze(-1) + coords.view(*([1] * d), -1))
    return h.to(torch.float32) * (1.0 / 2**32)


def random_tensor(name: str, shape: tuple[int, ...], cut: tuple[int, int, int] | None, dtype, device, seed: int,
                  std: float) -> torch.Tensor:
    """Parameter `name`'s slice `cut` (axis, start, stop; None: all of it) of shape `shape`, made in chunks of rows."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype, device=device)
    ranges = [range(n) for n in shape]
    if cut is not None:
        axis, start, stop = cut
        ranges[axis] = range(start, stop)
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = max(1, CHUNK // math.prod(shape[1:]))
    width = std * math.sqrt(12.0)  # a uniform of this width has standard deviation std
    key = _key(seed, name)
    for i in range(0, shape[0], rows):
        first = ranges[0][i:i + rows]
        out[i:i + len(first)] = (hashed(key, [first, *ranges[1:]], device) - 0.5) * width
    return out


def random_params(graph: Graph, dtype: str, device, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Every parameter of `graph` (a rank's graph: each its cut of the whole) as dense `dtype` on `device`."""
    tdtype = weights.DTYPES[dtype]
    return {name: random_tensor(name, p.shape, p.cut, tdtype, device, seed, std) for name, p in graph.params.items()}
