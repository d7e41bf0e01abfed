"""frontend.engine.gc_pauses: the start-up's objects out of the collector's full walks (EngineSpec.load calls it)."""

from __future__ import annotations

import gc


def test_freeze_startup_takes_the_live_objects_out_of_full_collections():
    """After freeze_startup every object alive before it is in the permanent generation, which no collection walks
    (gc.get_objects lists the three that are walked); objects made later are walked, and their garbage collected."""
    from frontend.engine.gc_pauses import freeze_startup

    held = [{"i": i, "l": [i]} for i in range(50_000)]  # a loaded engine's long-lived objects, roughly
    try:
        assert freeze_startup() >= 2 * len(held)  # (a frozen object freed by its count leaves the permanent one)
        assert gc.get_freeze_count() >= 2 * len(held)
        walked = {id(o) for o in gc.get_objects()}
        assert not walked & {id(h) for h in held[::97]}
        later = [[1]]
        assert id(later) in {id(o) for o in gc.get_objects()}
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # garbage made after the freeze is collected
    finally:
        gc.unfreeze()
    assert id(held[0]) in {id(o) for o in gc.get_objects()}
