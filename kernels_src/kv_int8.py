"""The 8-bit KV cache's layout and its quantizing write: DSL kernel, host launcher and numpy references.

An int8 paged cache is the float one's [num_blocks, block_size, Hkv, D] as int8 codes, beside an fp32 scale per group
of GROUP elements along the head dim ([num_blocks, block_size, Hkv, D / GROUP]). Symmetric absmax groups: a group's
scale is max|x| / 127 and its codes round(x / scale), so dequantizing is codes * scale (the attention kernels do it
in registers, see paged_attend.attend). Group 32, as MLX's int8 cache (backends/mlx/kv_quant.py): SmolLM2's keys
have outlier channels that a whole-head scale spreads over every other channel. A token then costs D + 4 D / 32
bytes a head and tensor: 1.125 bytes an element against bf16's 2 (1.78x the tokens in the same budget).
"""

from __future__ import annotations

import numpy as np

from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.kv_write import check_caches, quantized_write_ref

GROUP = 32
QMAX = 127.0
TINY = 1e-30  # an all-zero group divides by this and stores scale 0 (codes 0), not 0/0


def check_head_dim(dim: int) -> None:
    """Refuses a head dim the groups do not tile."""
    if dim % GROUP:
        raise ValueError(f"--kv-cache-dtype int8 quantizes each cached vector in groups of {GROUP} elements; a head "
                         f"dim of {dim} is not a multiple of {GROUP} (use --kv-cache-dtype auto)")


def _quant_store(x, codes, scales, dst, sdst, mask, smask):
    """Quantizes x [..., G, GROUP] (fp32) per last-axis group: codes at dst, one scale per group at sdst."""
    amax = tl.max(tl.abs(x), axis=2)
    inv = QMAX / tl.maximum(amax, TINY)
    q = tl.floor(x * inv[:, :, None] + 0.5)  # round half up: the reference does the same
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(codes + dst, q.to(tl.int8), mask=mask)
    tl.store(scales + sdst, amax / QMAX, mask=smask)


def kv_write_int8_kernel(k, v, k_cache, v_cache, k_scales, v_scales, slots, n_heads, k_stride, k_head_stride,
                         v_stride, v_head_stride, GROUPS: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    if PDL:  # k, v and the slot mapping may all be earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None, None]
    g = tl.arange(0, BLOCK_G)[None, :, None]
    e = tl.arange(0, GROUP)[None, None, :]
    d = g * GROUP + e
    mask = (h < n_heads) & (g < GROUPS) & (slot >= 0)
    dst = slot * (n_heads * GROUPS * GROUP) + h * (GROUPS * GROUP) + d
    hs, gs = tl.arange(0, BLOCK_H)[:, None], tl.arange(0, BLOCK_G)[None, :]
    sdst = slot * (n_heads * GROUPS) + hs * GROUPS + gs
    smask = (hs < n_heads) & (gs < GROUPS) & (slot >= 0)
    kv = tl.load(k + t * k_stride + h * k_head_stride + d, mask=mask, other=0.0).to(tl.float32)
    vv = tl.load(v + t * v_stride + h * v_head_stride + d, mask=mask, other=0.0).to(tl.float32)
    _quant_store(kv, k_cache, k_scales, dst, sdst, mask, smask)
    _quant_store(vv, v_cache, v_scales, dst, sdst, mask, smask)


# --- host side -------------------------------------------------------------------------------------------------

def scales_shape(cache_shape) -> tuple[int, ...]:
    """The scales beside a code cache of `cache_shape` [num_blocks, block_size, Hkv, D]."""
    *lead, d = cache_shape
    check_head_dim(d)
    return (*lead, d // GROUP)


def check_scales(k_cache, v_cache, k_scales, v_scales) -> None:
    """The codes are int8 and contiguous, the scales of scales_shape beside them."""
    want = scales_shape(tuple(k_cache.shape))
    for name, c, s in (("k", k_cache, k_scales), ("v", v_cache, v_scales)):
        if str(c.dtype).rsplit(".", 1)[-1] != "int8" or tuple(s.shape) != want:
            raise ValueError(f"{name} cache {tuple(c.shape)} {c.dtype} with scales {tuple(s.shape)}: want int8 codes "
                             f"and float32 scales {want}")
    if any(elem_stride(c, 3) != 1 for c in (k_cache, v_cache, k_scales, v_scales)):
        raise ValueError("int8 caches and their scales need contiguous last dims")


def scale_strides(k_scales) -> tuple[int, int, int]:
    return elem_stride(k_scales, 0), elem_stride(k_scales, 1), elem_stride(k_scales, 2)


def kv_write_int8(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, *, target: str = "numpy",
                  pdl: bool | None = None) -> None:
    """Quantize k, v [T, Hkv, D] (token and head strides free, D contiguous) into int8 paged caches and scales."""
    t, h, d = check_caches(k, k_cache, v_cache)
    check_scales(k_cache, v_cache, k_scales, v_scales)
    if t == 0:
        return
    pdl = use_pdl(target, pdl)
    groups = d // GROUP
    kern = compile(kv_write_int8_kernel, target, launch_pdl=pdl, GROUPS=groups, BLOCK_H=tl.next_power_of_2(h),
                   BLOCK_G=tl.next_power_of_2(groups), PDL=pdl)
    kern[t](k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, h, elem_stride(k, 0), elem_stride(k, 1),
            elem_stride(v, 0), elem_stride(v, 1))


# --- references --------------------------------------------------------------------------------------------------

def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes like x, fp32 scales [..., D / GROUP]) of x [..., D], as the kernel computes them."""
    g = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, GROUP)
    amax = np.abs(g).max(-1)
    inv = np.float32(QMAX) / np.maximum(amax, np.float32(TINY))
    q = np.clip(np.floor(g * inv[..., None] + np.float32(0.5)), -QMAX, QMAX)
    return q.astype(np.int8).reshape(x.shape), (amax / np.float32(QMAX)).astype(np.float32)


def dequantize_ref(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 values of int8 codes [..., D] with their group scales [..., D / GROUP]."""
    g = codes.astype(np.float32).reshape(*codes.shape[:-1], -1, GROUP)
    return (g * scales[..., None].astype(np.float32)).reshape(codes.shape)


def kv_write_int8_ref(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scales: np.ndarray,
                      v_scales: np.ndarray, slot_mapping: np.ndarray) -> None:
    quantized_write_ref(quantize_ref, k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping)
