"""The FP8 (e4m3) KV cache's layout and its quantizing write: DSL kernel, host launcher and numpy references.

An fp8 paged cache is the float one's [num_blocks, block_size, Hkv, D] as e4m3 bytes (uint8, one a value, as vLLM's
fp8 cache), beside one fp32 scale per token and head ([num_blocks, block_size, Hkv]): scale = max|x| / 448 over the
head's D values, codes = e4m3(x / scale) (kernels_src/e4m3.py: nearest even, saturated to +-448). One scale a head,
not int8's one per 32 values: e4m3 keeps 3 significant bits across 17 binades below its largest value, so a head's
small channels beside an outlier channel keep their relative precision (int8's 254 uniform steps do not, hence its
groups). Dequantizing is then per token, not per element: the attention kernels scale a tile's scores by its keys'
scales and its probabilities by its values' (paged_attention.attend). A token costs D + 4 bytes a head and tensor:
1 + 4 / D bytes an element (1.03 at D = 128, 1.94x the tokens of a 16-bit cache).

NaN: a head holding a NaN stores a NaN scale (its NaN values code 0x7F, as torch's cast), so attention reads NaN for
that token as it would from a 16-bit cache; an infinity gives a scale of inf, read as NaN too.
"""

from __future__ import annotations

import numpy as np

from ir.formats import fp8_blocks
from kernels_src import e4m3
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.kv_int8 import scale_strides  # noqa: F401  (the same block, token and head strides: quant_args')
from kernels_src.kv_write import check_caches, quantized_write_ref

TINY = 1e-30  # an all-zero head divides by this and stores scale 0 (codes 0), not 0/0


def _quant_store(x, codes, scales, dst, sdst, mask, smask):
    """Quantizes x [BLOCK_H, BLOCK_D] (fp32, padding 0) per head: e4m3 codes at dst, one scale per head at sdst."""
    finite = x == x
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)  # NaN-free on every target (GPU max drops NaN)
    nan = tl.max(tl.where(finite, 0.0, 1.0), axis=1) > 0.0
    inv = e4m3.E4M3_MAX / tl.maximum(amax, TINY)
    tl.store(codes + dst, e4m3.encode(x * inv[:, None]).to(tl.uint8), mask=mask)
    tl.store(scales + sdst, tl.where(nan, float("nan"), amax / e4m3.E4M3_MAX), mask=smask)


def kv_write_fp8_kernel(k, v, k_cache, v_cache, k_scales, v_scales, slots, n_heads, k_stride, k_head_stride,
                        v_stride, v_head_stride, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    if PDL:  # k, v and the slot mapping may all be earlier kernels' outputs
        tl.wait_prior_grid()
        tl.launch_dependents()
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)[None, :]
    hmask = (h < n_heads) & (slot >= 0)
    mask = hmask[:, None] & (d < HEAD_DIM)
    dst = slot * (n_heads * HEAD_DIM) + h[:, None] * HEAD_DIM + d
    sdst = slot * n_heads + h
    kv = tl.load(k + t * k_stride + h[:, None] * k_head_stride + d, mask=mask, other=0.0).to(tl.float32)
    vv = tl.load(v + t * v_stride + h[:, None] * v_head_stride + d, mask=mask, other=0.0).to(tl.float32)
    _quant_store(kv, k_cache, k_scales, dst, sdst, mask, hmask)
    _quant_store(vv, v_cache, v_scales, dst, sdst, mask, hmask)


# --- host side -------------------------------------------------------------------------------------------------

def scales_shape(cache_shape) -> tuple[int, ...]:
    """The scales beside a code cache of `cache_shape` [num_blocks, block_size, Hkv, D]: one per token and head."""
    return tuple(cache_shape[:-1])


def check_scales(k_cache, v_cache, k_scales, v_scales) -> None:
    """The codes are uint8 (e4m3 bytes) and contiguous, the fp32 scales of scales_shape beside them, contiguous."""
    want = scales_shape(tuple(k_cache.shape))
    for name, c, s in (("k", k_cache, k_scales), ("v", v_cache, v_scales)):
        if str(c.dtype).rsplit(".", 1)[-1] != "uint8" or tuple(s.shape) != want or "float32" not in str(s.dtype):
            raise ValueError(f"{name} cache {tuple(c.shape)} {c.dtype} with scales {tuple(s.shape)} {s.dtype}: want "
                             f"uint8 e4m3 codes and float32 scales {want}")
        for t in (c, s):
            dims = tuple(t.shape)
            strides = [elem_stride(t, i) for i in range(len(dims))]
            if strides != [int(np.prod(dims[i + 1:])) for i in range(len(dims))]:
                raise ValueError(f"fp8 caches and their scales must be contiguous ({name}: {dims}, strides {strides})")


def kv_write_fp8(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, *, target: str = "numpy",
                 pdl: bool | None = None) -> None:
    """Quantize k, v [T, Hkv, D] (token and head strides free, D contiguous) into e4m3 paged caches and scales."""
    t, h, d = check_caches(k, k_cache, v_cache)
    check_scales(k_cache, v_cache, k_scales, v_scales)
    if elem_stride(k, 2) != 1 or elem_stride(v, 2) != 1:
        raise ValueError("k and v need contiguous head dims")
    if t == 0:
        return
    pdl = use_pdl(target, pdl)
    kern = compile(kv_write_fp8_kernel, target, launch_pdl=pdl, HEAD_DIM=d, BLOCK_H=tl.next_power_of_2(h),
                   BLOCK_D=tl.next_power_of_2(d), PDL=pdl)
    kern[t](k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, h, elem_stride(k, 0), elem_stride(k, 1),
            elem_stride(v, 0), elem_stride(v, 1))


# --- references --------------------------------------------------------------------------------------------------

def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes uint8 like x, fp32 scales x.shape[:-1]) of x [..., D], as the kernel computes them."""
    x = np.asarray(x, np.float32)
    finite = ~np.isnan(x)
    amax = np.where(finite, np.abs(x), np.float32(0)).max(-1)
    inv = np.float32(fp8_blocks.E4M3_MAX) / np.maximum(amax, np.float32(TINY))
    with np.errstate(invalid="ignore"):  # an infinity times inv = 0
        y = x * inv[..., None]
    bad = np.isnan(y)
    codes = fp8_blocks.encode(np.where(bad, np.float32(0), y))
    codes = np.where(bad, np.uint8(0x7F) | (np.signbit(y).astype(np.uint8) << 7), codes).astype(np.uint8)
    scales = np.where(finite.all(-1), amax / np.float32(fp8_blocks.E4M3_MAX), np.float32(np.nan))
    return codes, scales.astype(np.float32)


def dequantize_ref(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 values of e4m3 codes [..., D] with their per-vector scales [...]."""
    return fp8_blocks.decode(codes) * np.asarray(scales, np.float32)[..., None]


def kv_write_fp8_ref(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_scales: np.ndarray,
                     v_scales: np.ndarray, slot_mapping: np.ndarray) -> None:
    quantized_write_ref(quantize_ref, k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping)
