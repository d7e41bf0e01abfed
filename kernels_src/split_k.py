"""Split-K for the DSL's GEMMs (dequant_gemm, dense_gemm, gguf_mmq, the integer-group and FP8 GEMMs): when a grid of
M tiles x N tiles would not fill the GPU (N = 4096 with K = 14336: 64 programs), SPLIT programs share a tile's K
range and write fp32 partials [SPLIT, M, N], which dequant_gemm_reduce_kernel adds into y. The choice of SPLIT
(split_k_for), the launches of a kernel and its reduce (split_k_plan, launch_split_k), a program's K loop and tile
store (split_k_tile, store_tile) and the output's check (gemm_out). The grid and the scratch depend on (M, N, K)
only, so the launches are safe inside CUDA graphs.
"""

from __future__ import annotations

from kernels_src.dsl import compile, elem_stride, empty, tl

SMS = 132  # H200 (and H100 SXM) SMs: the grid the split-K choice aims to fill when the device does not say
WAVE_PROGRAMS = 2  # programs an SM should get before K is split (2-3 fit an SM at the default tiles)
MIN_SPLIT_STEPS = 4  # steps a split keeps at least (each ends in a partial's store and a read in the reduce)
PART_BYTES = 16 * 2**20  # fp32 partials at most: they stay in L2 between the GEMM and the reduce
REDUCE_BLOCK = 1024


def split_k_tile(step, lo, steps_per_split, n_steps, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP: bool):
    """A GEMM program's K loop (`acc = step(it, acc)` over its split's steps) and the store of its tile of y (or of
    its split's fp32 partial): acc is [len(n), len(m)] under SWAP (W @ x.T), else [len(m), len(n)]."""
    shape = (n.shape[0], m.shape[0]) if SWAP else (m.shape[0], n.shape[0])
    acc = tl.fori_loop(lo, tl.minimum(lo + steps_per_split, n_steps), step, tl.zeros(shape, tl.float32))
    store_tile(acc, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP)


def store_tile(acc, y, m, n, m_rows, n_rows, y_stride, split_stride, SWAP: bool):
    """A GEMM program's store of its tile of y (or of its split's fp32 partial), acc [len(n), len(m)] under SWAP."""
    dst = y + tl.program_id(2).to(tl.int64) * split_stride
    if SWAP:
        tl.store(dst + m[None, :] * y_stride + n[:, None], acc, mask=(m[None, :] < m_rows) & (n[:, None] < n_rows))
    else:
        tl.store(dst + m[:, None] * y_stride + n[None, :], acc, mask=(m[:, None] < m_rows) & (n[None, :] < n_rows))


def dequant_gemm_reduce_kernel(part, y, n_rows, y_stride, split_stride, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr = False):
    """y[m, n] = sum over s of part[s, m, n] (part [SPLIT, M, N] contiguous); program (i, m)."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = tl.program_id(1)
    if PDL:
        tl.wait_prior_grid()
        tl.launch_dependents()
    src = part + m * n_rows + n
    acc = tl.load(src, mask=n < n_rows, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc = acc + tl.load(src + s * split_stride, mask=n < n_rows, other=0.0)
    tl.store(y + m * y_stride + n, acc, mask=n < n_rows)


# --- host side -------------------------------------------------------------------------------------------------

_sms: dict = {}


def sm_count(like) -> int:
    dev = getattr(like, "device", None)
    if dev is None or getattr(dev, "type", "cpu") != "cuda":
        return SMS
    if dev not in _sms:
        import torch

        _sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _sms[dev]


def split_k_for(m: int, n: int, block_m: int, block_n: int, steps: int, sms: int, min_steps: int) -> int:
    """SPLIT for a K of `steps` steps: a power of two, grown until the grid gives every SM WAVE_PROGRAMS programs,
    while each split keeps min_steps steps and the fp32 partials fit PART_BYTES."""
    programs, split = tl.cdiv(m, block_m) * tl.cdiv(n, block_n), 1
    while (programs * split < WAVE_PROGRAMS * sms and steps // (2 * split) >= min_steps
           and 8 * split * m * n <= PART_BYTES):
        split *= 2
    return split


def split_k_plan(args: tuple, out, n_steps: int, split: int, block_m: int, block_n: int, target: str,
                 pdl: bool) -> tuple:
    """launch_split_k's launches for out [M, N]: (the GEMM's grid, its arguments after y; the reduce kernel, its grid
    and its arguments after (partials, out), or None, None, None; the split, 1 where y is out itself)."""
    m, n = out.shape
    per_split = tl.cdiv(n_steps, split)
    split = tl.cdiv(n_steps, per_split)  # no split left without steps
    grid = (tl.cdiv(m, block_m), tl.cdiv(n, block_n), split)
    if split == 1:
        return grid, (*args, elem_stride(out, 0), 0, n_steps, per_split), None, None, None, 1
    block = min(REDUCE_BLOCK, tl.next_power_of_2(n))
    red = compile(dequant_gemm_reduce_kernel, target, num_warps=4, launch_pdl=pdl, SPLIT=split, BLOCK=block, PDL=pdl)
    return (grid, (*args, n, m * n, n_steps, per_split), red, (tl.cdiv(n, block), m), (n, elem_stride(out, 0), m * n),
            split)


def launch_split_k(kern, inputs: tuple, args: tuple, out, n_steps: int, split: int, block_m: int, block_n: int,
                   target: str, pdl: bool):
    """Runs a split-K GEMM kernel (signature: *inputs, y, *args, y_stride, split_stride, n_steps, steps_per_split)
    over (M / block_m, N / block_n, split) programs: straight into out for one split, else into fp32 partials
    [split, M, N] summed by dequant_gemm_reduce_kernel."""
    grid, ints, red, red_grid, red_ints, split = split_k_plan(args, out, n_steps, split, block_m, block_n, target,
                                                              pdl)
    if red is None:
        kern[grid](*inputs, out, *ints)
        return out
    part = empty(out, (split, *out.shape), "float32")
    kern[grid](*inputs, part, *ints)
    red[red_grid](part, out, *red_ints)
    return out


def gemm_out(x2, out, n: int):
    """out [M, N] (made in x2's dtype when None), checked to be that shape with contiguous rows."""
    m = x2.shape[0]
    out = empty(x2, (m, n)) if out is None else out
    if tuple(out.shape) != (m, n) or (m and n and elem_stride(out, 1) != 1):
        raise ValueError(f"out {tuple(out.shape)} is not [{m}, {n}] with contiguous rows")
    return out
