"""The K loop of the one-row GEMVs (dequant_gemv's, int_group_gemv_i8's, fp8_gemv's), plain or prefetching.

A step loads its raw weight tiles, then computes on them with x. Plain, the sm_90 build issues a step's loads, waits
for them and computes: nothing is in flight across steps (Triton's pipeliner leaves a loop whose loads feed no dot
alone). Two ways to keep loads in flight across steps, each a tile key of the GEMVs:
- PREFETCH: the loop carries the next step's raw tiles in registers (step 0's loaded before it); the body issues
  step it + 1's loads before step it's arithmetic. The last step's prefetch loads the last step again (its index
  clamped: no address past what the plain loop reads) and is never used. It costs the carried tiles' registers,
  and ptxas copies the new tiles into the carried registers at the loop's end, where it then waits for them (after
  the arithmetic: the overlap is one step's arithmetic and x's loads).
- STAGES: Triton's own software pipelining of the loop (fori_loop's stages, tl.range's num_stages): cp.async into
  shared memory STAGES - 1 steps ahead (loads of 4 bytes and more; 16-bit ones stay synchronous). The pipeliner
  hoists every load of the first steps, x's too, above the loop, so a PDL kernel waits for its predecessor before the
  loop instead of inside it.
"""

from __future__ import annotations

from collections.abc import Callable

from kernels_src.dsl import tl


def _flat(raw: list) -> list:
    return [t for item in raw for t in (item if isinstance(item, list | tuple) else [item])]


def _shape(raw: list) -> list:
    return [len(item) if isinstance(item, list | tuple) else None for item in raw]


def _unflat(flat, shape: list) -> list:
    out, at = [], 0
    for n in shape:
        out.append(flat[at] if n is None else list(flat[at:at + n]))
        at += 1 if n is None else n
    return out


def _next_step(it, n_steps):
    """The step a prefetch loads during step it: the next, clamped to the last."""
    return tl.minimum(it + 1, n_steps - 1)


def k_loop(n_steps, load: Callable, compute: Callable, init: tuple, PREFETCH: bool = False, STAGES: int = 0):
    """The accumulators after `accs = compute(it, load(it), accs)` for it < n_steps: load(it) gives a step's raw
    weight tiles (a list of tiles or of lists of tiles), compute the new accumulators. PREFETCH, STAGES: above."""
    init = tuple(init)
    if not PREFETCH:
        return tl.fori_loop(0, n_steps, lambda it, *accs: tuple(compute(it, load(it), accs)), init, stages=STAGES)
    first = load(0)
    shape, n = _shape(first), len(init)

    def body(it, *carry):
        nxt = load(_next_step(it, n_steps))  # issued before this step's arithmetic on the carried tiles
        return (*compute(it, _unflat(carry[n:], shape), carry[:n]), *_flat(nxt))

    return tl.fori_loop(0, n_steps, body, init + tuple(_flat(first)), stages=STAGES)[:n]


# The tile keys that choose the loop's form (TUNED entries and the sweeps' settings), and their defaults: plain until
# a GPU times the others.
PREFETCH, STAGES = False, 0
MAX_STAGES = 4


def loop_form(tiles: dict, prefetch: bool | None = None, stages: int | None = None) -> tuple[bool, int]:
    """(PREFETCH, STAGES): the arguments where given, else `tiles`' prefetch and stages (a table's), else the
    defaults; ValueError naming a bad value."""
    prefetch = tiles.get("prefetch", PREFETCH) if prefetch is None else prefetch
    stages = tiles.get("stages", STAGES) if stages is None else stages
    bad = check_loop_keys(dict(prefetch=prefetch, stages=stages))
    if bad:
        raise ValueError(f"loop form: {'; '.join(bad)}")
    return prefetch, stages


def check_loop_keys(tiles: dict) -> list[str]:
    """What is off in a setting's loop keys, if it has them: prefetch a bool, stages 0 or 2 to MAX_STAGES."""
    bad = []
    if "prefetch" in tiles and not isinstance(tiles["prefetch"], bool):
        bad.append(f"prefetch {tiles['prefetch']!r} (a bool)")
    st = tiles.get("stages", 0)
    if type(st) is not int or not (st == 0 or 2 <= st <= MAX_STAGES):
        bad.append(f"stages {st!r} (0, or 2 to {MAX_STAGES})")
    return bad
