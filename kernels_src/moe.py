"""Fused mixture-of-experts over dense expert stacks [E, out, in]: DSL kernels, host launcher, reference.

Each token's top_k (expert, weight) slots are grouped by expert (`moe_align`: one kernel launch on Triton targets,
kernels_src/moe_align.py, else fixed-shape array ops; either way a step with experts stays capturable in a CUDA
graph): slot ids sorted by expert, each expert's run padded to BLOCK_M with the out-of-range id S = tokens * top_k,
and the expert of every BLOCK_M block. The grid is the bound on blocks,
cdiv(S, BLOCK_M) + E, whatever the routing; blocks past the used ones hold padding only and store nothing.
- moe_gemm_kernel(GATED): program (block, n tile) reads its expert once, gathers its slots' token rows of x and
  computes act(x @ gate[e].T) * (x @ up[e].T) for BLOCK_N columns of both in one pass over K: h [S, I], by slot.
- moe_gemm_kernel(not GATED): h's rows through down[e], each scaled by its slot's routing weight: y [S, H].
The tokens' outputs are the sums of their top_k rows of y (an array op after the launch).
Either pass may read GGUF blocks instead (kernels_src/moe_gguf.py: the same grid, each weight tile dequantized in
registers before the dot), so gate/up and down may each be dense or quantized, in any format of their own. At
prefill sizes a GGUF pass may instead dequantize its experts a chunk at a time to x's dtype and run this dense kernel
on each chunk (kernels_src/moe_dequant.py: LLM_ENGINE_MOE_DEQUANT=1, or moe_experts(dequant=True)). A pass over
Q4_K / Q6_K stacks may run on int8 tensor cores instead, x quantized per super-block first (kernels_src/moe_mmq.py,
on unless LLM_ENGINE_MOE_MMQ=0: below moe_mmq.MMQ_SLOTS_PER_EXPERT slots an expert, and from MMQ_MIN_SLOTS in place
of the GEMV below; or moe_experts(mmq=True)).
Small batches (at most moe_gemv.GEMV_SLOTS slots and no more than the experts, or four times that over GGUF stacks:
moe_gemv.use_gemv) group nothing:
kernels_src/moe_gemv.py runs each slot's expert as GEMVs, its id read in the kernel, over dense rows or through
dequant_gemv's per-format loop (three launches with the sum, against some thirty with moe_align's array ops).
"""

from __future__ import annotations

import os

import numpy as np

from kernels_src import moe_align as moe_align_kernel
from kernels_src import moe_dequant, moe_gemv, moe_gguf, moe_mmq
from kernels_src.activations import _act
from kernels_src.dsl import compile, elem_stride, empty, int_class, tl, use_pdl
from kernels_src.moe_slots import block_slots

__all__ = ["moe_align", "moe_experts", "moe_experts_ref"]

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
ALIGN_KERNEL = os.environ.get("LLM_ENGINE_MOE_ALIGN_KERNEL", "1") != "0"  # moe_align's one launch (torch, Triton)
_ALIGN_TARGETS = ("triton", "triton-interpret")


TALL_SLOTS_PER_EXPERT = 64  # default_tiles' 64-slot blocks from this many slots an expert on average
N_TILES = ((32, 16), (256, 32))  # default_tiles' (most slots, BLOCK_N) below BLOCK_N: narrow tiles for few slots


def _past(most: int) -> int:
    """The first slot count a rule `slots <= most` leaves: slot_bounds lists where each upper side starts."""
    return most + 1


def slot_bounds(experts: int) -> tuple[int, ...]:
    """Slot counts S (tokens x top_k) from which a step over `experts` experts may launch other kernels or constexprs
    than at S - 1 (the start of each rule's upper side), from the rules' own constants: default_tiles' taller blocks
    and BLOCK_N steps, the GEMV's bounds (dense and GGUF: moe_gemv.gemv_slots) and the int8 GEMV's (unless
    LLM_ENGINE_MOE_I8 fixes it), moe_dequant's (when on), moe_mmq's two (when on), moe_align's kernel's (when on:
    moe_align.supports). The start-up warm-up reaches each side of each (backends/cuda/warm_batches.counts_by_class,
    through slot_key). Untold: dequant_gemv.rule_tiles' ROWS over the GGUF GEMV's rows x slots, which changes below
    1,024 / rows slots (rows: a pass's outputs), under 16 tokens at any rows x top_k >= 64: the warm-up runs those
    one by one."""
    bounds = {TALL_SLOTS_PER_EXPERT * experts, *(_past(most) for most, _ in N_TILES),
              _past(moe_gemv.gemv_slots(experts, gguf=False)), _past(moe_gemv.gemv_slots(experts, gguf=True))}
    if moe_gemv.I8 is None:
        bounds.add(moe_gemv.I8_MIN_SLOTS)
    if moe_dequant.DEQUANT:
        bounds.add(moe_dequant.DEQUANT_SLOTS_PER_EXPERT * experts)
    if moe_mmq.MMQ:
        bounds |= {moe_mmq.MMQ_SLOTS_PER_EXPERT * experts, moe_mmq.MMQ_MIN_SLOTS}
    if ALIGN_KERNEL:
        bounds.add(_past(moe_align_kernel.MAX_SLOTS))
    return tuple(sorted(bounds))


def slot_key(slots: int, experts: int, bounds: tuple[int, ...] | None = None) -> tuple:
    """What of a slot count a step's MoE kernels are built for, besides the count's own integer class: its side of
    each slot_bounds bound (`bounds`, computed when not given) and, where moe_align's kernel takes the step, the
    integer class of its block count (an argument Triton specializes on: max_blocks at each block height the step's
    passes may take)."""
    sides = tuple(slots >= b for b in (slot_bounds(experts) if bounds is None else bounds))
    if not (ALIGN_KERNEL and moe_align_kernel.supports(slots, experts)):
        return sides
    heights = {default_tiles(slots, experts)[0], *((moe_mmq.BLOCK_M,) if moe_mmq.MMQ else ())}
    return sides + tuple(int_class(max_blocks(slots, experts, m)) for m in sorted(heights))


def default_tiles(slots: int, experts: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): a decode batch has a slot or two per expert, so its programs are few and each streams
    whole weight rows; narrow N tiles give the GPU more of them. Many slots per expert (prefill) take taller tiles."""
    block_m = 64 if slots >= TALL_SLOTS_PER_EXPERT * experts else BLOCK_M
    block_n = next((n for most, n in N_TILES if slots <= most), BLOCK_N)
    return block_m, block_n


def moe_gemm_kernel(x, w_a, w_b, y, rows, block_expert, weights, n_slots, n_cols, k_dim, n_steps, x_stride,
                    w_e_stride, w_stride, y_stride, TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, j): slots rows[b * BLOCK_M ..] (all of expert block_expert[b]), columns BLOCK_N j.. of y.
    GATED: y = act(x[tok] @ w_a[e].T) * (x[tok] @ w_b[e].T), tok = slot // TOP_K; else y = (x[slot] @ w_a[e].T) *
    weights[slot]. Rows past n_cols of W are clamped (read again, never stored); padding slots store nothing."""
    if PDL:  # x and the routing come from earlier kernels
        tl.wait_prior_grid()
        tl.launch_dependents()
    e, slot, valid, src, n = block_slots(rows, block_expert, n_slots, TOP_K, GATED, BLOCK_M, BLOCK_N)
    xrow = x + src.to(tl.int64)[:, None] * x_stride
    wrow = e * w_e_stride + tl.minimum(n, n_cols - 1).to(tl.int64)[:, None] * w_stride
    kk = tl.arange(0, BLOCK_K)[None, :]
    all_m = tl.arange(0, BLOCK_M)[:, None] >= 0  # masks spelled out at each load's full shape
    all_n = tl.arange(0, BLOCK_N)[:, None] >= 0

    def step(it, acc_a, acc_b):
        k0 = it * BLOCK_K
        kmask = (k0 + kk) < k_dim
        xv = tl.load(xrow + k0 + kk, mask=kmask & all_m, other=0.0)
        a = tl.load(w_a + wrow + k0 + kk, mask=kmask & all_n, other=0.0).to(xv.dtype)
        acc_a = tl.dot(xv, tl.trans(a), acc_a)
        if GATED:
            b = tl.load(w_b + wrow + k0 + kk, mask=kmask & all_n, other=0.0).to(xv.dtype)
            acc_b = tl.dot(xv, tl.trans(b), acc_b)
        return acc_a, acc_b

    zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # A block's real slots come first (padding ends each expert's run): a block of padding only, most of the grid
    # at small batches, skips the loop instead of streaming an expert's weights for nothing.
    steps = tl.where(tl.load(rows + tl.program_id(0) * BLOCK_M) < n_slots, n_steps, 0)
    acc_a, acc_b = tl.fori_loop(0, steps, step, (zero, zero))
    if GATED:
        out = _act(acc_a, ACT) * acc_b
    else:
        out = acc_a * tl.load(weights + src, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(y + slot.to(tl.int64)[:, None] * y_stride + n[None, :], out,
             mask=valid[:, None] & (n[None, :] < n_cols))


# --- host side -------------------------------------------------------------------------------------------------

def max_blocks(slots: int, experts: int, block_m: int) -> int:
    """Blocks of block_m slots any routing of `slots` slots over `experts` experts needs at most."""
    return tl.cdiv(slots, block_m) + experts


def moe_align(ids, experts: int, block_m: int, target: str | None = None, pdl: bool | None = None):
    """(rows [max_blocks * block_m] int32: slot ids grouped by expert, each run padded with S; block_expert
    [max_blocks] int32) for expert ids [T, top_k], in numpy or torch (the same fixed-shape ops: no host sync).
    Torch tensors on a Triton target take one launch of kernels_src/moe_align.py instead where it fits
    (moe_align.supports: up to 1,024 slots, 256 experts), unless LLM_ENGINE_MOE_ALIGN_KERNEL=0: its outputs are
    integers computed exactly, bit-identical to the array ops' (tests/test_kernels_moe_align.py); pdl: the kernel's
    launch (None: where the target has it)."""
    if isinstance(ids, np.ndarray):
        return _align(np, ids.reshape(-1).astype(np.int64), experts, block_m)
    import torch

    flat = ids.reshape(-1)
    if ALIGN_KERNEL and target in _ALIGN_TARGETS and moe_align_kernel.supports(int(flat.shape[0]), experts):
        n_blocks = max_blocks(int(flat.shape[0]), experts, block_m)
        return moe_align_kernel.moe_align(flat.contiguous(), experts, block_m, n_blocks, target, pdl)
    return _align(torch, flat.long(), experts, block_m)


def _align(xp, flat, experts: int, block_m: int):
    s = int(flat.shape[0])
    nblocks = max_blocks(s, experts, block_m)
    if xp is np:
        counts = np.bincount(flat, minlength=experts)
        order = np.argsort(flat, kind="stable")
        arange = np.arange
        rows = np.full(nblocks * block_m, s, np.int64)
    else:
        counts = xp.zeros(experts, dtype=xp.int64, device=flat.device).scatter_add_(0, flat, xp.ones_like(flat))
        order = xp.argsort(flat, stable=True)
        arange = lambda n: xp.arange(n, device=flat.device)  # noqa: E731
        rows = xp.full((nblocks * block_m,), s, dtype=xp.int64, device=flat.device)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = xp.cumsum(padded, 0)
    first = xp.cumsum(counts, 0) - counts  # each expert's first position in sorted order
    expert_of = flat[order]
    dest = (ends - padded)[expert_of] + arange(s) - first[expert_of]
    rows[dest] = order
    starts = arange(nblocks) * block_m
    if xp is np:
        block_expert = np.minimum(np.searchsorted(ends, starts, side="right"), experts - 1)
        return rows.astype(np.int32), block_expert.astype(np.int32)
    block_expert = xp.searchsorted(ends, starts, right=True).clamp(max=experts - 1)
    return rows.to(xp.int32), block_expert.to(xp.int32)


def _shape(w) -> tuple[int, ...]:
    return tuple(w.shape)


def _check_stacks(t: int, h: int, w_gate, w_up, w_down) -> None:
    e, inner = _shape(w_gate)[:2]
    if _shape(w_up) != _shape(w_gate) or _shape(w_down) != (e, h, inner) or _shape(w_gate)[2] != h:
        raise ValueError(f"expert stacks {_shape(w_gate)}, {_shape(w_up)}, {_shape(w_down)} do not fit x [{t}, {h}]")
    if moe_gguf.is_blocks(w_gate) != moe_gguf.is_blocks(w_up):
        raise ValueError("gate and up stacks must both be dense or both GGUF blocks")
    for w, out, k, what in ((w_gate, inner, h, "gate"), (w_up, inner, h, "up"), (w_down, h, inner, "down")):
        if moe_gguf.is_blocks(w):
            moe_gguf.check_stack(w, e, out, k, what)
        elif elem_stride(w, 2) != 1:
            raise ValueError(f"{what}: dense expert stacks need contiguous rows")
    if not moe_gguf.is_blocks(w_gate) and [elem_stride(w_up, i) for i in (0, 1)] != \
            [elem_stride(w_gate, i) for i in (0, 1)]:
        raise ValueError("dense gate and up stacks need one layout")


def moe_experts(x, weights, ids, w_gate, w_up, w_down, act: str = "silu", *, out=None, target: str = "numpy",
                pdl: bool | None = None, gemv: bool | None = None, dequant: bool | None = None,
                mmq: bool | None = None, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None):
    """sum over k of weights[t, k] * w_down[e] @ (act(w_gate[e] @ x[t]) * (w_up[e] @ x[t])), e = ids[t, k], for x
    [T, H] (rows contiguous), weights [T, k] fp32, ids [T, k], stacks [E, I, H] / [E, H, I]: dense with contiguous
    rows, or GGUF blocks (moe_gguf.GGUFStack; gate and up both or neither); out [T, H] (made in x's dtype when not
    given). gemv: the per-slot GEMVs of kernels_src/moe_gemv.py (None: where moe_gemv.use_gemv says) or the grouped
    kernels; dequant: the grouped path's GGUF passes through experts dequantized a chunk at a time and the dense
    kernel (None: where moe_dequant.use_dequant says); mmq: the grouped path's Q4_K / Q6_K passes on int8 tensor
    cores (kernels_src/moe_mmq.py; None: where moe_mmq.use_mmq says, before dequant, and from moe_mmq.MMQ_MIN_SLOTS
    slots in place of the GEMV, moe_mmq.over_gemv); block_n, block_k: the dense
    tiles (a GGUF pass steps by whole blocks)."""
    t, h = x.shape
    k = ids.shape[1]
    e, inner = _shape(w_gate)[:2]
    _check_stacks(t, h, w_gate, w_up, w_down)
    if elem_stride(x, 1) != 1:
        x = x.contiguous() if hasattr(x, "contiguous") else np.ascontiguousarray(x)
    s = t * k
    flat_w = weights.reshape(-1)
    pdl = use_pdl(target, pdl)
    hidden = empty(x, (s, inner))
    y = empty(x, (s, h))
    if gemv is None:
        gemv = moe_gemv.use_gemv(s, e, (w_gate, w_up, w_down)) and not (
            mmq is not False and moe_mmq.over_gemv(s, w_gate, w_up, h))
    if gemv:
        moe_gemv.run(x, flat_w, ids.reshape(-1), w_gate, w_up, w_down, hidden, y, top_k=k, act=act, target=target,
                     pdl=pdl, block_n=block_n, block_k=block_k)
    else:
        if dequant is None:
            dequant = moe_dequant.use_dequant(s, e, (w_gate, w_up, w_down))
        if mmq is None:
            mmq = moe_mmq.use_mmq(s, e)
        _grouped(x, flat_w, ids, w_gate, w_up, w_down, hidden, y, k, act, target, pdl, block_m, block_n,
                 block_k or BLOCK_K, dequant, mmq)
    out = empty(x, (t, h)) if out is None else out
    if isinstance(y, np.ndarray):
        np.sum(y.reshape(t, k, h), axis=1, out=out)
    else:
        import torch

        torch.sum(y.view(t, k, h), dim=1, out=out)
    return out


def _grouped(x, flat_w, ids, w_gate, w_up, w_down, hidden, y, k: int, act: str, target: str, pdl: bool,
             block_m: int | None, block_n: int | None, block_k: int, dequant: bool = False,
             mmq: bool = False) -> None:
    """The two grouped passes: slots aligned by expert (moe_align), then a program a block of one expert's slots;
    mmq: Q4_K / Q6_K passes on int8 tensor cores (moe_mmq; others as below); dequant: GGUF passes as chunks of
    dequantized experts through the dense kernel (moe_dequant.chunks)."""
    s, (e, inner), h = y.shape[0], _shape(w_gate)[:2], y.shape[1]
    passes = ((True, (w_gate, w_up, x, hidden, inner, h)), (False, (w_down, w_down, hidden, y, h, inner)))
    mmq_passes = [mmq and moe_mmq.takes(a, b, gated, k_dim) for gated, (a, b, _, _, _, k_dim) in passes]
    tiles = default_tiles(s, e)
    if any(mmq_passes):  # its blocks of slots, for both passes (they share the alignment)
        tiles = (moe_mmq.BLOCK_M, tiles[1])
    block_m, default_n = block_m or tiles[0], tiles[1]
    rows, block_expert = moe_align(ids, e, block_m, target, pdl)
    nblocks = block_expert.shape[0]
    for on_mmq, (gated, (a, b, src, dst, n_cols, k_dim)) in zip(mmq_passes, passes, strict=True):
        if on_mmq:
            moe_mmq.launch(src, a, b, dst, rows, block_expert, flat_w, s, gated=gated, top_k=k, act=act,
                           block_m=block_m, target=target, pdl=pdl, block_n=block_n)
            continue
        if moe_gguf.is_blocks(a) and not dequant:
            n_tile, warps = moe_gguf.pass_tiles((a.qtype, b.qtype), gated, block_m, default_n)
            moe_gguf.launch(src, a, b, dst, rows, block_expert, flat_w, s, k_dim, gated=gated, top_k=k, act=act,
                            block_m=block_m, block_n=block_n or n_tile, target=target, pdl=pdl, num_warps=warps)
            continue
        n_tile = block_n or default_n
        warps = moe_dequant.warps(gated, block_m, n_tile) if moe_gguf.is_blocks(a) else 4
        kern = compile(moe_gemm_kernel, target, num_warps=warps, launch_pdl=pdl, TOP_K=k, GATED=gated, ACT=act,
                       BLOCK_M=block_m, BLOCK_N=n_tile, BLOCK_K=block_k, PDL=pdl)
        # dense stacks as they are; GGUF ones a chunk of dequantized experts a launch, the other chunks' blocks
        # padding in that launch's rows
        parts = [(a, b, rows, block_expert)] if not moe_gguf.is_blocks(a) else moe_dequant.chunks(
            src, a, b, rows, block_expert, s, gated=gated, block_m=block_m, target=target, pdl=pdl)
        for wa, wb, r, be in parts:
            kern[nblocks, tl.cdiv(n_cols, n_tile)](src, wa, wb, dst, r, be, flat_w, s, n_cols, k_dim,
                                                     tl.cdiv(k_dim, block_k), elem_stride(src, 0), elem_stride(wa, 0),
                                                     elem_stride(wa, 1), elem_stride(dst, 0))


def moe_experts_ref(x, weights, ids, w_gate, w_up, w_down, act: str = "silu") -> np.ndarray:
    """The same in float64, token by token, slot by slot; GGUF stacks dequantized first (our numpy dequantizer)."""
    from ir.interpreter import KERNELS

    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    gate, up, down = (np.asarray(moe_gguf.dequantize_stack(w) if moe_gguf.is_blocks(w) else w, np.float64)
                      for w in (w_gate, w_up, w_down))
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids)[t]):
            h = KERNELS[act](gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += weights[t, j] * (down[e] @ h)
    return out
