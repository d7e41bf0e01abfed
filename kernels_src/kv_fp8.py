"""The FP8 (e4m3) KV cache's layout and its quantizing write: DSL kernel, host launcher and numpy references.

An fp8 paged cache is the float one's [num_blocks, block_size, Hkv, D] as e4m3 bytes (uint8, one a value, as vLLM's
fp8 cache), beside one fp32 scale per token and head ([num_blocks, block_size, Hkv]): scale = max|x| / 448 over the
head's D values, codes = e4m3(x / scale) (kernels_src/e4m3.py: nearest even, saturated to +-448). One scale a head,
not int8's one per 32 values: e4m3 keeps 3 significant bits across 17 binades below its largest value, so a head's
small channels beside an outlier channel keep their relative precision (int8's 254 uniform steps do not, hence its
groups). Dequantizing is then per token, not per element: the attention kernels scale a tile's scores by its keys'
scales and its probabilities by its values' (paged_attend.attend). A token costs D + 4 bytes a head and tensor:
1 + 4 / D bytes an element (1.03 at D = 128, 1.94x the tokens of a 16-bit cache).

V's codes are stored token-minor (V_TOKEN_MINOR): the logical [num_blocks, block_size, Hkv, D] over a contiguous
[num_blocks, Hkv, D, block_size] buffer (`new_v_cache`, `token_minor`), so a block's tokens sit side by side for each
dim and a block stays one piece of the buffer (K's block stride). The PV dot reduces over tokens: its V tile, read
along tokens, is then 16-byte vectors (block_size 16) as K's is along D for the QK dot, where token-major bytes sat
Hkv * D apart, a byte a load out of shared memory. The write takes V's four strides; attention a constexpr
(V_TOKEN_MINOR: strides known to the compiler, `load_v`). Either layout reads the same values: only addresses differ.

NaN: a head holding a NaN stores a NaN scale (its NaN values code 0x7F, as torch's cast), so attention reads NaN for
that token as it would from a 16-bit cache; an infinity gives a scale of inf, read as NaN too.
"""

from __future__ import annotations

import os

import numpy as np

from ir.formats import fp8_blocks
from kernels_src import e4m3
from kernels_src.dsl import compile, elem_stride, tl, use_pdl
from kernels_src.kv_int8 import scale_strides  # noqa: F401  (the same block, token and head strides: quant_args')
from kernels_src.kv_write import check_caches, quantized_write_ref

TINY = 1e-30  # an all-zero head divides by this and stores scale 0 (codes 0), not 0/0
# LLM_ENGINE_FP8_V_TOKEN_MINOR=0 keeps V's codes token-major, as K's (the layout before 2026-12-05).
V_TOKEN_MINOR = os.environ.get("LLM_ENGINE_FP8_V_TOKEN_MINOR", "1") != "0"


def _quant_store(x, codes, scales, dst, sdst, mask, smask):
    """Quantizes x [BLOCK_H, BLOCK_D] (fp32, padding 0) per head: e4m3 codes at dst, one scale per head at sdst."""
    finite = x == x
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)  # NaN-free on every target (GPU max drops NaN)
    nan = tl.max(tl.where(finite, 0.0, 1.0), axis=1) > 0.0
    inv = e4m3.E4M3_MAX / tl.maximum(amax, TINY)
    tl.store(codes + dst, e4m3.encode(x * inv[:, None]).to(tl.uint8), mask=mask)
    tl.store(scales + sdst, tl.where(nan, float("nan"), amax / e4m3.E4M3_MAX), mask=smask)


def kv_write_fp8_kernel(k, v, k_cache, v_cache, k_scales, v_scales, slots, n_heads, k_stride, k_head_stride,
                        v_stride, v_head_stride, block_size, vc_block_stride, vc_tok_stride, vc_head_stride,
                        vc_dim_stride, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr = False):
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
    vdst = ((slot // block_size) * vc_block_stride + (slot % block_size) * vc_tok_stride + h[:, None] * vc_head_stride
            + d * vc_dim_stride)  # V's codes: either layout (token_minor)
    _quant_store(vv, v_cache, v_scales, vdst, sdst, mask, hmask)


def load_v(v_cache, base, toks, bvalid, d, dmask, BS, valid=None):
    """V's [BLOCK_N, BLOCK_D] tile of token-minor codes (`base`: each token's block and head offset) for the PV dot,
    tokens at stride 1, loaded whole blocks at a time (`bvalid`: the token's block holds a valid one) so that 16
    tokens are one vector. `valid` (a tile holding tokens past the last): those read as 0, since their bytes may be
    any, NaN codes too (0 * NaN is NaN); 128 selects an element at 128 keys a tile, hence only the last tile's."""
    vt = tl.load(v_cache + (base + toks % BS)[:, None] + d[None, :] * BS, mask=bvalid[:, None] & dmask[None, :],
                 other=0)
    return vt if valid is None else tl.where(valid[:, None], vt, 0)


def window_start(first, BS, scales):
    """The first key a window lets in (`first`, any integer), rounded down to a cache block over an fp8 cache
    (`scales`: attention's CacheScales): tiles then start on a block, as the compiler sees, so a token-minor V's
    tile loads in vectors. The window's mask is exact either way: only the tiles' split moves (hence rounding),
    alike in both V layouts."""
    return first // BS * BS if scales is not None and scales.fp8 else first


# --- host side -------------------------------------------------------------------------------------------------

def scales_shape(cache_shape) -> tuple[int, ...]:
    """The scales beside a code cache of `cache_shape` [num_blocks, block_size, Hkv, D]: one per token and head."""
    return tuple(cache_shape[:-1])


def _logical(buf):
    """A [num_blocks, Hkv, D, block_size] buffer (numpy or torch) seen as V's logical [num_blocks, block_size, Hkv,
    D]."""
    return buf.transpose(0, 3, 1, 2) if isinstance(buf, np.ndarray) else buf.permute(0, 3, 1, 2)


def token_minor(v_cache):
    """V's codes [num_blocks, block_size, Hkv, D] (numpy or torch) copied into the token-minor layout: a view of the
    same shape over a contiguous [num_blocks, Hkv, D, block_size] buffer."""
    if isinstance(v_cache, np.ndarray):
        return _logical(np.ascontiguousarray(v_cache.transpose(0, 2, 3, 1)))
    return _logical(v_cache.permute(0, 2, 3, 1).contiguous())


def new_v_cache(shape, zeros):
    """V's codes of logical `shape` [num_blocks, block_size, Hkv, D] from `zeros` (a shape -> array): token-minor
    unless V_TOKEN_MINOR is off."""
    if not V_TOKEN_MINOR:
        return zeros(shape)
    nb, bs, h, d = shape
    return _logical(zeros((nb, h, d, bs)))


def v_strides(v_cache) -> tuple[int, int, int, int]:
    """V's codes' block, token, head and dim strides, as the kernels take them (either layout)."""
    return tuple(elem_stride(v_cache, i) for i in range(4))


def is_token_minor(c) -> bool:
    """Whether V's codes `c` are token-minor: a contiguous [num_blocks, Hkv, D, block_size] buffer."""
    nb, bs, h, d = tuple(c.shape)
    return v_strides(c) == (h * d * bs, 1, d * bs, bs)


def check_scales(k_cache, v_cache, k_scales, v_scales) -> None:
    """The codes are uint8 (e4m3 bytes) and contiguous (V's: or token-minor), the fp32 scales of scales_shape beside
    them, contiguous."""
    want = scales_shape(tuple(k_cache.shape))
    for name, c, s in (("k", k_cache, k_scales), ("v", v_cache, v_scales)):
        if str(c.dtype).rsplit(".", 1)[-1] != "uint8" or tuple(s.shape) != want or "float32" not in str(s.dtype):
            raise ValueError(f"{name} cache {tuple(c.shape)} {c.dtype} with scales {tuple(s.shape)} {s.dtype}: want "
                             f"uint8 e4m3 codes and float32 scales {want}")
        for t in (s,) if name == "v" and is_token_minor(c) else (c, s):
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
            elem_stride(v, 0), elem_stride(v, 1), k_cache.shape[1], *v_strides(v_cache))


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
