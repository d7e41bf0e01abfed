"""KV-cache write through a slot mapping: DSL kernel, host launcher and numpy reference.

k, v [T, Hkv, D] go to caches [num_blocks, block_size, Hkv, D] at slot_mapping[t] = block * block_size + offset;
a negative slot skips the token (padding). One program writes one token's heads; offsets into the cache are i64.
"""

from __future__ import annotations

import numpy as np

from kernels_src.dsl import compile, elem_stride, tl, use_pdl


def kv_write_kernel(k, v, k_cache, v_cache, slots, n_heads, head_dim, k_stride, k_head_stride, v_stride,
                    v_head_stride, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    if PDL:  # k, v and the slot mapping may all be earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < head_dim) & (slot >= 0)
    dst = slot * (n_heads * head_dim) + h * head_dim + d
    kv = tl.load(k + t * k_stride + h * k_head_stride + d, mask=mask, other=0.0)
    vv = tl.load(v + t * v_stride + h * v_head_stride + d, mask=mask, other=0.0)
    tl.store(k_cache + dst, kv, mask=mask)
    tl.store(v_cache + dst, vv, mask=mask)


def check_caches(k, k_cache, v_cache) -> tuple[int, int, int]:
    """(T, Hkv, D) of k [T, Hkv, D], once both caches are seen to hold [*, *, Hkv, D]."""
    t, h, d = k.shape
    if tuple(k_cache.shape[2:]) != (h, d) or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold [*, *, {h}, {d}]")
    return t, h, d


def kv_write(k, v, k_cache, v_cache, slot_mapping, *, target: str = "numpy", pdl: bool | None = None) -> None:
    """Write k, v [T, Hkv, D] (token and head strides free, D contiguous) into contiguous paged caches."""
    t, h, d = check_caches(k, k_cache, v_cache)
    pdl = use_pdl(target, pdl)
    kern = compile(kv_write_kernel, target, launch_pdl=pdl, BLOCK_H=tl.next_power_of_2(h),
                   BLOCK_D=tl.next_power_of_2(d), PDL=pdl)
    kern[t](k, v, k_cache, v_cache, slot_mapping, h, d, elem_stride(k, 0), elem_stride(k, 1), elem_stride(v, 0),
            elem_stride(v, 1))


def kv_write_ref(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 slot_mapping: np.ndarray) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def quantized_write_ref(quantize, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        k_scales: np.ndarray, v_scales: np.ndarray, slot_mapping: np.ndarray) -> None:
    """An 8-bit cache's write: each token's k and v heads through `quantize` (-> codes, scales) into its slot."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if slot >= 0:
            at = (slot // block_size, slot % block_size)
            k_cache[at], k_scales[at] = quantize(k[t])
            v_cache[at], v_scales[at] = quantize(v[t])
