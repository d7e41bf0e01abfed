"""Python's cyclic garbage collector kept off the objects a serving process builds at start-up.

A loaded engine holds hundreds of thousands of long-lived objects (the model's graph and parameters' wrappers, the
kernels' compiled launchers and their caches, the tokenizer's tables): SmolLM2 on this CPU's MLX backend ~190,000,
whose full collection took 40 ms (session 18). Full collections are rare (the collector waits until the objects that
survived its younger generations reach a quarter of the old ones), but one inside a decode step delays it by that
much. `freeze_startup` collects once and moves what survives to the permanent generation (gc.freeze), which later
collections skip (the same collection then took under 0.01 ms), as vLLM's engine does after its start-up. Objects
made later are collected as before; only cyclic garbage among the frozen objects (none that a serving process lets
go of) would stay. (The decode benchmark, tools/bench_gpu_rates.GcPauses, saw no run where collections took 1% of
the timed steps on an H100, frozen or not: this removes a rare pause, not a steady cost.)
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("frontend")


def freeze_startup() -> int:
    """Collects, then freezes every object alive now; returns how many are frozen (logged with the time taken)."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects kept out of garbage collection (%.0f ms)", frozen, (time.perf_counter() - t) * 1e3)
    return frozen
