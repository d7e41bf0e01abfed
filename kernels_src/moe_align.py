"""moe_align in one launch of one program: a step's top-k slots grouped by expert (kernels_src/moe.py's `_align`,
whose torch spelling is some twenty to thirty tiny kernels a MoE layer: bincount, a stable argsort, cumsums,
gathers, searchsorted), for up to MAX_SLOTS slots over up to MAX_EXPERTS experts; past that the caller keeps the
array ops. Integers only, so its outputs are bit-identical to `_align`'s:
- counts per expert by [BLOCK_C, BLOCK_S] compare-and-sum over tiles of slots, BLOCK_C experts at a time; each
  expert's run padded to BLOCK_M, its start and end (exclusive, inclusive prefix of the padded sizes) by
  [E, BLOCK_C] triangular masks;
- rows filled with S (the padding id), block_expert[b] = min(#ends <= b * BLOCK_M, E - 1) (searchsorted, right);
- a barrier (the scatter below overwrites the fill, by other threads), then a tile of slots at a time, in order:
  each slot's rank among its expert's earlier slots, those of the tiles before (a running count per expert, carried
  through the loop) plus those before it in its tile ([BLOCK_S, BLOCK_S] triangular compare), and it stores its id at
  start[expert] + rank. Every pass is linear in the slots: S / BLOCK_S steps (8 at Qwen3's 512 slots).
The grid is one program whatever the routing: no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

from kernels_src.dsl import compile, empty, tl, use_pdl

MAX_SLOTS = 1024  # one program's passes grow with the slots, the array ops' cost barely: where they cross is untimed
MAX_EXPERTS = 256
NUM_WARPS = 8  # no spills on sm_90 at 8 to 256 experts (tests/test_kernels_moe_align.py)
TILE = 8192  # elements of the launcher's [E, slots] / [blocks, E] compare tiles (32 a thread at 8 warps)


def moe_align_kernel(ids, rows, block_expert, n_slots, n_experts, n_rows, n_blocks, BLOCK_M: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_B: tl.constexpr, PDL: tl.constexpr = False):
    """ids [n_slots] (any integer type) -> rows [n_rows] int32, block_expert [n_blocks] int32, as `_align`."""
    if PDL:  # the ids come from the router
        tl.wait_prior_grid()
        tl.launch_dependents()
    e = tl.arange(0, BLOCK_E)
    ss = tl.arange(0, BLOCK_S)
    n_tiles = (n_slots + BLOCK_S - 1) // BLOCK_S

    def slot_ids(it):  # padding lanes -1: no expert
        s = it * BLOCK_S + ss
        return s, tl.load(ids + s, mask=s < n_slots, other=-1).to(tl.int32)

    def counter(ec):  # counts of the experts ec, over every tile of slots
        def count(it, acc):
            _, x = slot_ids(it)
            return acc + tl.sum(tl.where(ec[:, None] == x[None, :], 1, 0), axis=1)
        return count

    # experts a chunk at a time: the prefix tile [E, BLOCK_C], not [E, E] (which spills at 256 experts)
    starts = tl.zeros([BLOCK_E], tl.int32)  # exclusive prefix of the padded sizes; lanes past E: 0 padded
    ends = tl.zeros([BLOCK_E], tl.int32)  # inclusive
    for c in tl.static_range(BLOCK_E // BLOCK_C):
        ec = c * BLOCK_C + tl.arange(0, BLOCK_C)
        counts = tl.fori_loop(0, n_tiles, counter(ec), tl.zeros([BLOCK_C], tl.int32))
        padded = ((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M)[None, :]
        starts += tl.sum(tl.where(ec[None, :] < e[:, None], padded, 0), axis=1)
        ends += tl.sum(tl.where(ec[None, :] <= e[:, None], padded, 0), axis=1)

    rr = tl.arange(0, BLOCK_R)

    def fill(it):
        p = it * BLOCK_R + rr
        # a sum, not tl.full: Triton 3.6 passes an integer argument equal to 1 as a constexpr, which full refuses
        tl.store(rows + p, tl.zeros([BLOCK_R], tl.int32) + n_slots, mask=p < n_rows)

    tl.fori_loop(0, (n_rows + BLOCK_R - 1) // BLOCK_R, fill)

    bb = tl.arange(0, BLOCK_B)

    def blocks(it):
        b = it * BLOCK_B + bb
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < n_experts)
        be = tl.minimum(tl.sum(tl.where(before, 1, 0), axis=1), n_experts - 1)
        tl.store(block_expert + b, be, mask=b < n_blocks)

    tl.fori_loop(0, (n_blocks + BLOCK_B - 1) // BLOCK_B, blocks)
    tl.debug_barrier()  # every thread's fill stored before any slot's id overwrites it

    def scatter(it, base):  # base [BLOCK_E]: each expert's slots in the tiles before this one
        si, xi = slot_ids(it)
        r = tl.sum(tl.where((xi[None, :] == xi[:, None]) & (ss[None, :] < ss[:, None]), 1, 0), axis=1)
        mine = xi[:, None] == e[None, :]
        at = tl.sum(tl.where(mine, (starts + base)[None, :], 0), axis=1)
        tl.store(rows + at + r, si, mask=si < n_slots)
        return base + tl.sum(tl.where(mine, 1, 0), axis=0)

    tl.fori_loop(0, n_tiles, scatter, tl.zeros([BLOCK_E], tl.int32))


def supports(slots: int, experts: int) -> bool:
    return 0 < slots <= MAX_SLOTS and 0 < experts <= MAX_EXPERTS


def tiles(experts: int) -> dict:
    """The constexpr tiles for `experts` experts: compare tiles of at most about TILE elements (the rank pass's
    [BLOCK_S, BLOCK_S] too)."""
    block_e = max(16, tl.next_power_of_2(experts))
    block_s = min(64, max(16, TILE // block_e))
    return dict(BLOCK_E=block_e, BLOCK_C=min(block_e, 128), BLOCK_S=block_s, BLOCK_R=1024, BLOCK_B=block_s)



def moe_align(flat_ids, experts: int, block_m: int, n_blocks: int, target: str, pdl: bool | None = None):
    """(rows [n_blocks * block_m] int32, block_expert [n_blocks] int32) for expert ids [S] (numpy or torch), as
    kernels_src/moe.py's `_align` gives them; n_blocks its max_blocks(S, experts, block_m)."""
    s = int(flat_ids.shape[0])
    if not supports(s, experts):
        raise ValueError(f"{s} slots over {experts} experts: the kernel takes up to {MAX_SLOTS} slots, "
                         f"{MAX_EXPERTS} experts")
    rows, block_expert = empty(flat_ids, (n_blocks * block_m,), "int32"), empty(flat_ids, (n_blocks,), "int32")
    pdl = use_pdl(target, pdl)
    kern = compile(moe_align_kernel, target, num_warps=NUM_WARPS, launch_pdl=pdl, BLOCK_M=block_m, PDL=pdl,
                   **tiles(experts))
    kern[1](flat_ids, rows, block_expert, s, experts, n_blocks * block_m, n_blocks)
    return rows, block_expert
