"""Rotary embedding fused with the KV-cache write: DSL kernel, host launcher and numpy reference.

One launch does what rope.rope then kv_write.kv_write do at an attention layer: q [T, Hq, D] is rotated in place,
k [T, Hkv, D] is rotated on its way into k_cache and v copied into v_cache, both at slot_mapping[t] (negative:
padding, nothing written). k itself is left as it was: the caller reads k from the cache afterwards. The rotation
is rope's, written as the same fp32 expressions and rounded to k's dtype before the cache store, so the cache holds
bit for bit what the two unfused kernels leave there. One program handles one token.
"""

from __future__ import annotations

import numpy as np

from kernels_src.dsl import Plans, compile, elem_stride, signature, tl, use_pdl
from kernels_src.kv_write import kv_write_ref
from kernels_src.rope import rope_ref


def _rotated(heads, first, second, mask, c, s):
    """The rotated (x[first], x[second]) pairs of the heads at `heads` [BLOCK_H, 1], as rope_kernel computes them."""
    x1 = tl.load(heads + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(heads + second[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1 * c[None, :] - x2 * s[None, :], x2 * c[None, :] + x1 * s[None, :]


def rope_kv_write_kernel(q, k, v, k_cache, v_cache, slots, positions, cos, sin, n_q_heads, n_kv_heads, q_stride,
                         q_head_stride, k_stride, k_head_stride, v_stride, v_head_stride, table_stride,
                         HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # q, k, v come from the kernel before; the table rows need positions, so nothing loads before this
        tl.wait_prior_grid()
        tl.launch_dependents()
    t = tl.program_id(0)
    pos = tl.load(positions + t).to(tl.int32)
    slot = tl.load(slots + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    rmask = i < HALF
    c = tl.load(cos + pos * table_stride + i, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin + pos * table_stride + i, mask=rmask, other=0.0).to(tl.float32)
    first, second = (2 * i, 2 * i + 1) if INTERLEAVED else (i, i + HALF)

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qmask = (hq < n_q_heads) & rmask[None, :]
    qb = q + t * q_stride + hq * q_head_stride
    y1, y2 = _rotated(qb, first, second, qmask, c, s)
    tl.store(qb + first[None, :], y1, mask=qmask)
    tl.store(qb + second[None, :], y2, mask=qmask)

    h = tl.arange(0, BLOCK_HK)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    row = slot * (n_kv_heads * HEAD_DIM) + h * HEAD_DIM  # i64: a cache may hold more than 2**31 elements
    kmask = (h < n_kv_heads) & rmask[None, :] & (slot >= 0)
    kb = k + t * k_stride + h * k_head_stride
    y1, y2 = _rotated(kb, first, second, kmask, c, s)
    kty = k.dtype.element_ty  # rope rounds to k's dtype first, kv_write then converts to the cache's
    tl.store(k_cache + row + first[None, :], y1.to(kty), mask=kmask)
    tl.store(k_cache + row + second[None, :], y2.to(kty), mask=kmask)
    if 2 * HALF < HEAD_DIM:  # dims past rotary_dim go to the cache as they are
        tail = (h < n_kv_heads) & (d >= 2 * HALF) & (d < HEAD_DIM) & (slot >= 0)
        kt = tl.load(kb + d, mask=tail, other=0.0)
        tl.store(k_cache + row + d, kt, mask=tail)
    vmask = (h < n_kv_heads) & (d < HEAD_DIM) & (slot >= 0)
    vv = tl.load(v + t * v_stride + h * v_head_stride + d, mask=vmask, other=0.0)
    tl.store(v_cache + row + d, vv, mask=vmask)


# --- host side -------------------------------------------------------------------------------------------------

# the arguments' shapes, strides and dtypes and the options -> (launch on its grid, the integer arguments)
_PLANS = Plans()


def _contiguous(a) -> bool:
    return a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_contiguous()


def _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin) -> None:
    if q.ndim != 3 or k.ndim != 3 or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want [T, H, D], v like k")
    (t, _, d), (_, hk, _) = q.shape, k.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens and head_dim")
    if d > 1 and any(elem_stride(x, 2) != 1 for x in (q, k, v)):
        raise ValueError("q, k, v need contiguous head dims (token and head strides are free)")
    if tuple(k_cache.shape[2:]) != (hk, d) or tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.ndim != 4:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not both hold [*, *, {hk}, {d}]")
    if not (_contiguous(k_cache) and _contiguous(v_cache)):
        raise ValueError("the caches must be contiguous")
    if len(slot_mapping) < t or len(positions) < t:
        raise ValueError(f"{t} tokens but {len(slot_mapping)} slots and {len(positions)} positions")
    if tuple(sin.shape) != tuple(cos.shape) or 2 * cos.shape[1] > d:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: want equal [*, <= {d // 2}]")


def rope_kv_write(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, *, interleaved: bool = False,
                  pdl: bool | None = None, target: str = "numpy") -> None:
    """Rotate q [T, Hq, D] in place; write rotated k and v [T, Hkv, D] into the paged caches at slot_mapping."""
    key = None
    if type(q) is not np.ndarray:  # a runner's: the checks and the kernel of these shapes are kept
        key = (signature(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin), interleaved, pdl, target)
        if (plan := _PLANS.get(key)) is not None:
            launch, ints = plan
            launch(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, *ints)
            return
    _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin)
    (t, hq, d), hk, half = q.shape, k.shape[1], cos.shape[1]
    if t == 0:
        return
    pdl = use_pdl(target, pdl)
    kern = compile(rope_kv_write_kernel, target, launch_pdl=pdl, HALF=half, HEAD_DIM=d,
                   BLOCK_HQ=tl.next_power_of_2(hq), BLOCK_HK=tl.next_power_of_2(hk), BLOCK_R=tl.next_power_of_2(half),
                   BLOCK_D=tl.next_power_of_2(d), INTERLEAVED=bool(interleaved), PDL=pdl)
    launch = kern.bind(t)
    ints = (hq, hk, elem_stride(q, 0), elem_stride(q, 1), elem_stride(k, 0), elem_stride(k, 1), elem_stride(v, 0),
            elem_stride(v, 1), elem_stride(cos, 0))
    launch(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, *ints)
    if key is not None:
        _PLANS.put(key, (launch, ints))


def rope_kv_write_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                      interleaved: bool = False) -> np.ndarray:
    """rope_ref then kv_write_ref: writes the caches, returns the rotated q (a new array)."""
    positions = np.asarray(positions)[:q.shape[0]]
    kv_write_ref(rope_ref(k, positions, cos, sin, interleaved), v, k_cache, v_cache,
                 np.asarray(slot_mapping)[:q.shape[0]])
    return rope_ref(q, positions, cos, sin, interleaved)
