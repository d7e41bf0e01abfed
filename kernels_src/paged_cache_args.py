"""The paged caches' host-side checks and launch arguments, shared by the decode and prefill launchers
(paged_attention, paged_prefill): shapes that agree, strides, and the 8-bit caches' kernels and scales."""

from __future__ import annotations

from kernels_src import e4m3, kv_fp8, kv_int8
from kernels_src.dsl import elem_stride


def check_cache(q, k_cache, v_cache) -> tuple[int, int]:
    """(GQA group, cache block size) after checking the shapes agree."""
    hq, d = q.shape[-2:]
    _, bs, hkv, dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or dk != d or hq % hkv:
        raise ValueError(f"q [.., {hq}, {d}] does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    fp8_v = str(v_cache.dtype).endswith("uint8") and kv_fp8.is_token_minor(v_cache)  # quant_args' V_TOKEN_MINOR
    if not fp8_v and [elem_stride(v_cache, i) for i in range(4)] != [elem_stride(k_cache, i) for i in range(4)]:
        raise ValueError("k and v caches must share strides")
    if elem_stride(k_cache, 3) != 1 or elem_stride(q, 2) != 1:
        raise ValueError("head dims must be contiguous")
    return hq // hkv, bs


def cache_strides(k_cache) -> tuple[int, int, int]:
    return elem_stride(k_cache, 0), elem_stride(k_cache, 1), elem_stride(k_cache, 2)


def quant_args(k_cache, v_cache, k_scales, v_scales, float_kernel, int8_kernel, fp8_kernel, target: str) -> tuple:
    """(cache arguments, kernel, scale strides, extra constexprs) for float caches (no scales), int8 ones (int8
    codes) or fp8 ones (uint8 e4m3 codes: FP8_CVT where the target decodes by the FP8 conversion) with their
    scales."""
    if k_scales is None and v_scales is None:
        return (k_cache, v_cache), float_kernel, (), {}
    fp8 = str(k_cache.dtype).endswith("uint8")
    layout, kernel = (kv_fp8, fp8_kernel) if fp8 else (kv_int8, int8_kernel)
    layout.check_scales(k_cache, v_cache, k_scales, v_scales)
    extra = {"FP8_CVT": True} if fp8 and e4m3.use_cvt(target) else {}
    if fp8 and kv_fp8.is_token_minor(v_cache):  # V's codes [blocks, Hkv, D, BS] (K's: contiguous, check_scales)
        extra["V_TOKEN_MINOR"] = True
    return (k_cache, v_cache, k_scales, v_scales), kernel, layout.scale_strides(k_scales), extra
