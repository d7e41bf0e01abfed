"""The 8-bit KV cache (`--kv-cache-dtype int8`): each cached K, V (or MLA latent) vector kept as MLX's affine groups.

A quantized cache is three arrays over the same slots as the float one: the 8-bit codes packed four to a uint32
([slots, heads, dim / 4]) and a scale and a bias per group along the head dim ([slots, heads, dim / group], in the
activations' dtype), `mx.quantize`'s own layout. The write quantizes this step's rows; attention gathers the slots it
reads and dequantizes them (`mx.dequantize`), so a block is re-read exactly as it was written, whoever reuses it.

Group 32, MLX's smallest: SmolLM2's keys carry outlier channels, and a 64-wide group (one per head) let them widen
every step of the head enough to change its greedy tokens, where 32 keeps them (tests/test_mlx_kv_int8.py). The scale
and bias cost 2 * itemsize / 32 bytes an element on top of its byte: 1.125 bytes at f16 (1.78x the tokens of the f16
cache), 1.25 at f32 (MLX's CPU default: 3.2x). Head dims that are not a multiple of 32 are refused.
"""

from __future__ import annotations

from typing import NamedTuple

from backends.mlx.runtime import mx
from core.kv_layout import LayerCache

BITS = 8
GROUP = 32


class QuantizedCache(NamedTuple):
    """One paged cache tensor as 8-bit affine groups (see the module docstring)."""

    codes: mx.array  # [slots, heads, dim / 4] uint32
    scales: mx.array  # [slots, heads, dim / group]
    biases: mx.array

    @property
    def group(self) -> int:
        return self.codes.shape[-1] * (32 // BITS) // self.scales.shape[-1]


def group_size(dim: int) -> int:
    """The group along a cached vector of `dim` elements; a dim MLX cannot group is refused."""
    if dim % GROUP:
        raise ValueError(f"--kv-cache-dtype int8 quantizes each cached vector in groups of {GROUP} elements; a head "
                         f"(or MLA latent) dim of {dim} is not a multiple of {GROUP} (use --kv-cache-dtype auto)")
    return GROUP


def allocate(slots: int, heads: int, dim: int, dtype) -> QuantizedCache:
    """A zeroed quantized cache of `slots` vectors a head."""
    groups = dim // group_size(dim)
    codes = mx.zeros((slots, heads, dim * BITS // 32), mx.uint32)
    return QuantizedCache(codes, mx.zeros((slots, heads, groups), dtype), mx.zeros((slots, heads, groups), dtype))


def token_bytes(shape: LayerCache, itemsize: int) -> int:
    """Bytes one token takes in one layer's quantized cache (codes, scales and biases)."""
    dims = [shape.key_dim] + ([] if shape.values_in_keys else [shape.value_dim])
    return shape.heads * sum(d * BITS // 8 + 2 * itemsize * (d // group_size(d)) for d in dims)


def write(cache, slots: mx.array, x: mx.array):
    """Writes rows x [T, heads, dim] at `slots` of a float cache or a QuantizedCache (quantized first)."""
    if not isinstance(cache, QuantizedCache):
        cache[slots] = x
        return cache
    codes, scales, biases = mx.quantize(x.astype(cache.scales.dtype), group_size=cache.group, bits=BITS)
    cache.codes[slots] = codes
    cache.scales[slots] = scales
    cache.biases[slots] = biases
    return cache


def read(cache, slots: mx.array) -> mx.array:
    """The vectors at `slots` (any index shape), dequantized from a QuantizedCache."""
    if not isinstance(cache, QuantizedCache):
        return cache[slots]
    return mx.dequantize(cache.codes[slots], cache.scales[slots], cache.biases[slots], group_size=cache.group,
                         bits=BITS)


def pack(layer: list, quantized: bool) -> list:
    """One layer's caches out of its flat arrays (three a QuantizedCache when `quantized`)."""
    return [QuantizedCache(*layer[i:i + 3]) for i in range(0, len(layer), 3)] if quantized else list(layer)


def flat(caches: list) -> list[mx.array]:
    """The arrays of one layer's caches, in pack's order."""
    return [a for c in caches for a in (c if isinstance(c, QuantizedCache) else (c,))]
