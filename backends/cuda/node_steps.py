"""run_nodes' walk through a list of nodes, worked out on the list's first run: an eager step's loop visits ~17 nodes a
layer, and each attribute walk it skips (inputs' kinds and names, outputs' ids, the values to drop) is host time the
GPU waits for."""

from __future__ import annotations

from ir.graph import Node

Step = tuple  # (node, its inputs as (True, value id) / (False, parameter name) / (None, None), its outputs' ids, the
# ids of the values no later node reads)


def steps(nodes: list[Node], drops: dict[int, list[int]]) -> list[Step]:
    """`nodes` as run_nodes walks them; `drops`: ir.Graph.last_reads (id(node) -> the values it reads last)."""
    return [(node, tuple((None, None) if v is None else (False, v.name) if v.kind == "param" else (True, v.id)
                         for v in node.inputs), tuple(v.id for v in node.outs), tuple(drops.get(id(node), ())))
            for node in nodes]


class Steps:
    """steps() of each list of nodes a runner runs (its graph's, or piecewise's pieces), kept by the list."""

    def __init__(self, drops: dict[int, list[int]]):
        self.drops = drops
        self._lists: dict[int, tuple[list[Node], list[Step]]] = {}  # id(list) -> (the list, its steps)

    def __call__(self, nodes: list[Node]) -> list[Step]:
        entry = self._lists.get(id(nodes))
        if entry is None or entry[0] is not nodes or len(entry[1]) != len(nodes):  # held: its id is not reused
            entry = self._lists[id(nodes)] = (nodes, steps(nodes, self.drops))
        return entry[1]
