"""One layer's paged KV cache tensors as the CUDA backend allocates them, zeroed: K and V [num_blocks, block_size,
heads, dim] in the activations' dtype (a latent layer's one cache: its values live in its keys), or an 8-bit cache's
codes and fp32 scales in kernels_src/kv_int8.py's or kv_fp8.py's layout (the fp8 cache's V codes token-minor where
kv_fp8.new_v_cache makes them so)."""

from __future__ import annotations

from functools import partial

from backends.cuda.runtime import torch
from kernels_src import kv_fp8, kv_int8


def layer_caches(n: int, block_size: int, s, dtype, kv_quant: str | None, device) -> tuple[torch.Tensor, ...]:
    """(k, v) or, for kv_quant "int8" / "fp8", (k codes, v codes, k scales, v scales) of `n` blocks for layer shape
    `s` (core.kv_layout's: heads, key_dim, value_dim, values_in_keys); one of each where the values are in the keys."""
    dims = (s.key_dim,) if s.values_in_keys else (s.key_dim, s.value_dim)
    if not kv_quant:
        return tuple(torch.zeros((n, block_size, s.heads, d), dtype=dtype, device=device) for d in dims)
    shape = (n, block_size, s.heads, s.key_dim)
    layout, codes = (kv_fp8, torch.uint8) if kv_quant == "fp8" else (kv_int8, torch.int8)
    zeros = partial(torch.zeros, dtype=codes, device=device)
    new_v = partial(kv_fp8.new_v_cache, zeros=zeros) if layout is kv_fp8 else zeros
    return (*(new(shape) for new in (zeros, new_v)[:len(dims)]),
            *(torch.zeros(layout.scales_shape(shape), device=device) for _ in dims))
