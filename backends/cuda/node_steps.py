"""run_nodes' walk through a list of nodes, worked out on the list's first run: an eager step's loop visits ~17 nodes a
layer, and each attribute walk it skips (inputs' kinds and names, outputs' ids, the values to drop, whether a GEMV
chain starts here and fits in the list, what a view node does) is host time the GPU waits for."""

from __future__ import annotations

from ir.graph import Node

Step = tuple  # (node, its inputs as (True, value id) / (False, parameter name) / (None, None), its outputs' ids, the
# ids of the values no later node reads, its view (a slice's or reshape's function of its input, else None), its
# chain (gemv_fusion.Chain starting here, whole in the list, with the drops of all its nodes; else None))


def view(node: Node):
    """A slice's or reshape's result as a function of its input (a view: no kernel, no run_node), else None."""
    if node.op == "slice":
        start, stop = node.attrs["start"], node.attrs["start"] + node.attrs["size"]
        return lambda t: t[..., start:stop]
    if node.op == "reshape":
        shape = tuple(-1 if isinstance(d, str) else d for d in node.attrs["shape"])
        return lambda t: t.reshape(*shape)  # unpacked: ~0.5 us faster than a tuple
    return None


def steps(nodes: list[Node], drops: dict[int, list[int]], chains: dict | None = None) -> list[Step]:
    """`nodes` as run_nodes walks them; `drops`: ir.Graph.last_reads (id(node) -> the values it reads last);
    `chains`: gemv_fusion.plan's (id(first node) -> Chain). A piece of a piecewise graph may end inside a chain: that
    chain is not one here."""
    out = []
    for i, node in enumerate(nodes):
        chain = (chains or {}).get(id(node))
        if chain is not None and tuple(nodes[i:i + len(chain.nodes)]) == chain.nodes:
            chain = (chain, tuple(v for n in chain.nodes for v in drops.get(id(n), ())))
        else:
            chain = None
        out.append((node, tuple((None, None) if v is None else (False, v.name) if v.kind == "param" else (True, v.id)
                                for v in node.inputs), tuple(v.id for v in node.outs),
                    tuple(drops.get(id(node), ())), view(node), chain))
    return out


class Steps:
    """steps() of each list of nodes a runner runs (its graph's, or piecewise's pieces), kept by the list."""

    def __init__(self, drops: dict[int, list[int]], chains: dict | None = None):
        self.drops, self.chains = drops, chains
        self._lists: dict[int, tuple[list[Node], list[Step]]] = {}  # id(list) -> (the list, its steps)

    def __call__(self, nodes: list[Node]) -> list[Step]:
        entry = self._lists.get(id(nodes))
        if entry is None or entry[0] is not nodes or len(entry[1]) != len(nodes):  # held: its id is not reused
            entry = self._lists[id(nodes)] = (nodes, steps(nodes, self.drops, self.chains))
        return entry[1]
