"""Python's cyclic garbage collector kept off the objects a serving process builds at start-up.

A loaded engine holds hundreds of thousands of long-lived objects (the model's graph and parameters' wrappers, the
kernels' compiled launchers and their caches, the tokenizer's tables). Every full collection walks all of them, and
an eager decode step allocates enough small objects (launch argument tuples, tensors' wrappers) to trigger one every
few dozen steps: a pause of milliseconds inside a step the GPU then waits for. `freeze_startup` collects once and
moves what survives to the permanent generation (gc.freeze), which later collections skip, as vLLM's engine does
after its start-up. Objects made later are collected as before; only cyclic garbage among the frozen objects (none
that a serving process lets go of) would stay.
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
