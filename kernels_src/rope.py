"""Rotary position embedding, in place on q and k: DSL kernel, host launcher and numpy reference.

cos/sin are tables [max_positions, rotary_dim // 2] (fp32, attention factor included; see ir.rope.cos_sin)
indexed by each token's position. "neox" rotates (x[i], x[i + half]) pairs, "interleaved" (x[2i], x[2i + 1]);
dims past rotary_dim are left as they are. One program rotates every head of q and k of one token, in fp32.
In place suits the backends: q and k are views into the fused qkv projection.
"""

from __future__ import annotations

import numpy as np

from kernels_src.dsl import compile, elem_stride, tl, use_pdl


def _rotate(base, n_heads, head_stride, c, s, i, rmask, HALF, BLOCK_H, INTERLEAVED):
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < n_heads) & rmask[None, :]
    first, second = (2 * i, 2 * i + 1) if INTERLEAVED else (i, i + HALF)
    p1 = base + h * head_stride + first[None, :]
    p2 = base + h * head_stride + second[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, x1 * c[None, :] - x2 * s[None, :], mask=mask)
    tl.store(p2, x2 * c[None, :] + x1 * s[None, :], mask=mask)


def rope_kernel(q, k, positions, cos, sin, n_q_heads, n_k_heads, q_stride, q_head_stride, k_stride, k_head_stride,
                table_stride, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    if PDL:  # positions may be a kernel's output too; the cos/sin rows follow from them
        tl.wait_prior_grid()
        tl.launch_dependents()
    pos = tl.load(positions + t).to(tl.int32)
    i = tl.arange(0, BLOCK_R)
    rmask = i < HALF
    c = tl.load(cos + pos * table_stride + i, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin + pos * table_stride + i, mask=rmask, other=0.0).to(tl.float32)
    _rotate(q + t * q_stride, n_q_heads, q_head_stride, c, s, i, rmask, HALF, BLOCK_H, INTERLEAVED)
    _rotate(k + t * k_stride, n_k_heads, k_head_stride, c, s, i, rmask, HALF, BLOCK_H, INTERLEAVED)


def rope(q, k, positions, cos, sin, *, interleaved: bool = False, target: str = "numpy",
         pdl: bool | None = None) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (or None) in place; rotary_dim = 2 * cos.shape[1]."""
    half = cos.shape[1]
    if 2 * half > q.shape[2]:
        raise ValueError(f"rotary_dim {2 * half} > head_dim {q.shape[2]}")
    n_k = 0 if k is None else k.shape[1]
    k = q if k is None else k
    pdl = use_pdl(target, pdl)
    kern = compile(rope_kernel, target, launch_pdl=pdl, HALF=half, BLOCK_H=tl.next_power_of_2(max(q.shape[1], n_k)),
                   BLOCK_R=tl.next_power_of_2(half), INTERLEAVED=bool(interleaved), PDL=pdl)
    kern[q.shape[0]](q, k, positions, cos, sin, q.shape[1], n_k, elem_stride(q, 0), elem_stride(q, 1),
                     elem_stride(k, 0), elem_stride(k, 1), elem_stride(cos, 0))


def rope_ref(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
             interleaved: bool = False) -> np.ndarray:
    """x [T, H, D] rotated (a new array of x's dtype)."""
    half = cos.shape[1]
    out = x.copy()
    xf = x.astype(np.float32)
    c, s = cos[positions][:, None, :].astype(np.float32), sin[positions][:, None, :].astype(np.float32)
    if interleaved:
        first, second = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
    else:
        first, second = np.arange(half), np.arange(half, 2 * half)
    x1, x2 = xf[..., first], xf[..., second]
    out[..., first] = (x1 * c - x2 * s).astype(x.dtype)
    out[..., second] = (x2 * c + x1 * s).astype(x.dtype)
    return out
