"""Thread layouts of tiles for the SIMT lowering: which thread and which register slot hold each element.

Tile dims and thread counts are powers of two, so a layout is a map of bits (a linear layout, as in Triton): each
bit of a thread's index and of a register slot's index names one bit of the element's row-major flat index, or,
for a thread bit, none (the threads differing in that bit hold the same elements: replication). Every element is
held by at least one thread, so no thread ever idles or needs a bounds guard. expand_dims and trans only relabel
bits; a broadcast sends its new bits to replicated thread bits, then to new slots; a reduction turns its thread
bits into replicated ones. Moving data between layouts that map the thread bits differently needs threadgroup
memory; layouts that differ only in their slot bits are the same registers, renumbered.
"""

from __future__ import annotations

from dataclasses import dataclass

LANE_BITS = 5  # 32 threads a simdgroup (Apple) / warp (NVIDIA)


def log2(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return n.bit_length() - 1


def nbits(shape) -> int:
    return sum(log2(s) for s in shape)


def dim_offsets(shape) -> list[int]:
    """The flat-index bit where each dim's bits start (row-major: the last dim has the low bits)."""
    offs, pos = [0] * len(shape), 0
    for d in range(len(shape) - 1, -1, -1):
        offs[d] = pos
        pos += log2(shape[d])
    return offs


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    tbits: tuple[int | None, ...]  # thread bit j -> flat-index bit (None: replicated)
    rbits: tuple[int, ...]  # slot bit k -> flat-index bit

    @property
    def nslots(self) -> int:
        return 1 << len(self.rbits)

    @property
    def replicated_mask(self) -> int:
        """Thread-index bits along which the data repeats (one owner thread has them all 0)."""
        return sum(1 << j for j, b in enumerate(self.tbits) if b is None)

    def thread_pairs(self) -> list[tuple[int, int]]:
        return [(j, b) for j, b in enumerate(self.tbits) if b is not None]

    def with_shape(self, shape) -> Layout:
        return Layout(tuple(shape), self.tbits, self.rbits)

    def same_threads(self, other: Layout) -> bool:
        """True when each element sits on the same thread in both (converting renumbers registers only)."""
        return self.tbits == other.tbits


def canonical(shape, nthreads: int) -> Layout:
    """Consecutive elements on consecutive threads (coalesced), then in slots: element e on thread e % T."""
    n, tb = nbits(shape), log2(nthreads)
    return Layout(tuple(shape), tuple(j if j < n else None for j in range(tb)), tuple(range(tb, n)))


def bit_map(src_shape, dst_shape) -> dict[int, int]:
    """Flat-bit renumbering between equal-rank shapes whose dims are equal or 1 in the source: src bit -> dst bit."""
    so, do = dim_offsets(src_shape), dim_offsets(dst_shape)
    return {so[d] + i: do[d] + i for d, s in enumerate(src_shape) for i in range(log2(s))}


def broadcast(lay: Layout, shape) -> tuple[Layout, list[int | None]]:
    """Layout of a broadcast to `shape` (same rank) and, per slot bit of it, the source's slot bit (None: repeated)."""
    shape = tuple(shape)
    moved = bit_map(lay.shape, shape)
    offs = dim_offsets(shape)
    new = [offs[d] + i for d, (s, t) in enumerate(zip(lay.shape, shape, strict=True)) if s == 1 and t > 1
           for i in range(log2(t))]
    tbits = [None if b is None else moved[b] for b in lay.tbits]
    for j in range(len(tbits)):
        if tbits[j] is None and new:
            tbits[j] = new.pop(0)
    rbits = [moved[b] for b in lay.rbits] + new
    return Layout(shape, tuple(tbits), tuple(rbits)), list(range(len(lay.rbits))) + [None] * len(new)


def transpose_bits(shape) -> dict[int, int]:
    """Flat-bit renumbering of a 2-d transpose: bit of [m, n] -> bit of [n, m]."""
    mb, nb = log2(shape[0]), log2(shape[1])
    return {b: (b - nb if b >= nb else b + mb) for b in range(mb + nb)}


def transpose(lay: Layout) -> Layout:
    perm = transpose_bits(lay.shape)
    return Layout(lay.shape[::-1], tuple(None if b is None else perm[b] for b in lay.tbits),
                  tuple(perm[b] for b in lay.rbits))


@dataclass(frozen=True)
class ReducePlan:
    out: Layout
    slot_axis: list[int]  # slot bits combined inside each thread
    slot_keep: list[int]  # slot bits of the source that become the result's slot bits, in order
    lane_axis: list[int]  # thread bits inside a simdgroup, combined by shuffles
    warp_axis: list[int]  # thread bits across simdgroups, combined through threadgroup memory


def reduce(lay: Layout, axis: int) -> ReducePlan:
    lo, nb = dim_offsets(lay.shape)[axis], log2(lay.shape[axis])
    in_axis = set(range(lo, lo + nb))
    renum = {b: (b if b < lo else b - nb) for b in range(nbits(lay.shape)) if b not in in_axis}
    shape = lay.shape[:axis] + lay.shape[axis + 1:]
    tbits = tuple(None if b is None or b in in_axis else renum[b] for b in lay.tbits)
    keep = [k for k, b in enumerate(lay.rbits) if b not in in_axis]
    taxis = [j for j, b in enumerate(lay.tbits) if b in in_axis]
    return ReducePlan(Layout(shape, tbits, tuple(renum[lay.rbits[k]] for k in keep)),
                      [k for k, b in enumerate(lay.rbits) if b in in_axis], keep,
                      [j for j in taxis if j < LANE_BITS], [j for j in taxis if j >= LANE_BITS])


def runs(pairs) -> tuple[tuple[int, int, int], ...]:
    """(src bit, dst bit) pairs as (src, dst, width) runs of consecutive bits, for compact bit-gather code."""
    out: list[list[int]] = []
    for s, d in sorted(pairs):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return tuple(tuple(r) for r in out)
