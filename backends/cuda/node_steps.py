"""run_nodes' walk through a list of nodes, worked out on the list's first run: an eager step's loop visits ~17 nodes a
layer, and each attribute walk it skips (inputs' kinds and names, outputs' ids, the values to drop, whether a GEMV
chain starts here and fits in the list, what a view node does) is host time the GPU waits for.

Views (slice, reshape: no kernel) are taken in the walk, not through run_node, and a run of slices of one value
(the fused q/k/v and gate/up projections' parts) as one split: a layer's 3 slices and 3 reshapes of q, k and v were
six torch calls (~7 us on a CPU), `view` + `split_with_sizes` are two (~3 us), with the same strides and offsets."""

from __future__ import annotations

from ir.graph import Node

Step = tuple  # (node, its inputs as (True, value id) / (False, parameter name) / (None, None), its outputs' ids, the
# ids of the values no later node reads, its views (below, or None), its chain (gemv_fusion.Chain starting here,
# whole in the list, with the drops of all its nodes; else None))
# Views: (function of the node's input -> a tuple of results, the nodes it stands for, their results' ids in env, the
# drops of all those nodes).


def view(node: Node):
    """A slice's or reshape's result as a function of its input, else None."""
    if node.op == "slice":
        start, stop = node.attrs["start"], node.attrs["start"] + node.attrs["size"]
        return lambda t: t[..., start:stop]
    if node.op == "reshape":
        shape = tuple(-1 if isinstance(d, str) else d for d in node.attrs["shape"])
        return lambda t: t.reshape(*shape)  # unpacked: ~0.5 us faster than a tuple
    return None


def _slice_run(nodes: list[Node], i: int) -> list[Node]:
    """The slices from nodes[i] on of one value's last dim, each starting where the one before ended."""
    run = [nodes[i]]
    while i + len(run) < len(nodes):
        nxt, last = nodes[i + len(run)], run[-1]
        if nxt.op != "slice" or nxt.inputs[0].id != last.inputs[0].id or \
                nxt.attrs["start"] != last.attrs["start"] + last.attrs["size"]:
            break
        run.append(nxt)
    return run


def _heads(nodes: list[Node], i: int, run: list[Node], readers: dict) -> tuple | None:
    """(head dim, each part's heads) where the nodes after the slices reshape each slice alone to [T, heads, D] (q, k,
    v of a fused projection), its only reader; else None."""
    after = nodes[i + len(run):i + 2 * len(run)]
    src = run[0].inputs[0]
    if len(after) < len(run) or len(src.shape) != 2:
        return None
    d, heads = None, []
    for s, r in zip(run, after, strict=True):
        shape = r.attrs.get("shape", ()) if r.op == "reshape" else ()
        if len(shape) != 3 or not isinstance(shape[0], str) or r.inputs[0].id != s.out.id or \
                readers.get(s.out.id) != [r] or d not in (None, shape[2]) or shape[1] * shape[2] != s.attrs["size"]:
            return None
        d = shape[2]
        heads.append(shape[1])
    return d, heads


def _split(nodes: list[Node], i: int, readers: dict, drops: dict) -> tuple | None:
    """Views standing for the run of slices at nodes[i] (and the reshapes of q, k, v after them) as one split."""
    run = _slice_run(nodes, i)
    total = run[0].inputs[0].shape[-1]
    first, end = run[0].attrs["start"], run[-1].attrs["start"] + run[-1].attrs["size"]
    if len(run) < 2 or not isinstance(total, int) or end > total:
        return None
    pad = [first] if first else []
    sizes = pad + [s.attrs["size"] for s in run] + ([total - end] if end < total else [])
    pick = slice(len(pad), len(pad) + len(run))
    heads = _heads(nodes, i, run, readers)
    singles = [view(s) for s in run]
    if heads is not None and first % heads[0] == 0 and total % heads[0] == 0:
        d, hs = heads
        hsizes = [n // d for n in sizes]
        hsizes[pick] = hs
        reshapes = [view(r) for r in nodes[i + len(run):i + 2 * len(run)]]

        def fn(x):
            if len(x.shape) == 2 and x.stride(-1) == 1:
                return x.view(x.shape[0], total // d, d).split_with_sizes(hsizes, 1)[pick]
            return tuple(r(s(x)) for s, r in zip(singles, reshapes, strict=True))

        done = nodes[i:i + 2 * len(run)]
    else:
        def fn(x):
            return x.split_with_sizes(sizes, -1)[pick]

        done = run
    return (fn, len(done), tuple(n.out.id for n in done[-len(run):]),
            tuple(v for n in done for v in drops.get(id(n), ())))


def _views(nodes: list[Node], i: int, readers: dict, drops: dict) -> tuple | None:
    node = nodes[i]
    if node.op == "slice" and (group := _split(nodes, i, readers, drops)) is not None:
        return group
    fn = view(node)
    return None if fn is None else (lambda x: (fn(x),), 1, (node.out.id,), tuple(drops.get(id(node), ())))


def steps(nodes: list[Node], drops: dict[int, list[int]], chains: dict | None = None,
          readers: dict | None = None) -> list[Step]:
    """`nodes` as run_nodes walks them; `drops`: ir.Graph.last_reads (id(node) -> the values it reads last);
    `chains`: gemv_fusion.plan's (id(first node) -> Chain); `readers`: ir.Graph.uses (a slice whose result another
    node reads is not folded into the split). A piece of a piecewise graph may end inside a chain or a run of
    views: that one is not one here."""
    out = []
    for i, node in enumerate(nodes):
        chain = (chains or {}).get(id(node))
        if chain is not None and tuple(nodes[i:i + len(chain.nodes)]) == chain.nodes:
            chain = (chain, tuple(v for n in chain.nodes for v in drops.get(id(n), ())))
        else:
            chain = None
        out.append((node, tuple((None, None) if v is None else (False, v.name) if v.kind == "param" else (True, v.id)
                                for v in node.inputs), tuple(v.id for v in node.outs),
                    tuple(drops.get(id(node), ())), _views(nodes, i, readers or {}, drops), chain))
    return out


class Steps:
    """steps() of each list of nodes a runner runs (its graph's, or piecewise's pieces), kept by the list."""

    def __init__(self, drops: dict[int, list[int]], chains: dict | None = None, readers: dict | None = None):
        self.drops, self.chains, self.readers = drops, chains, readers
        self._lists: dict[int, tuple[list[Node], list[Step]]] = {}  # id(list) -> (the list, its steps)

    def __call__(self, nodes: list[Node]) -> list[Step]:
        entry = self._lists.get(id(nodes))
        if entry is None or entry[0] is not nodes or len(entry[1]) != len(nodes):  # held: its id is not reused
            entry = self._lists[id(nodes)] = (nodes, steps(nodes, self.drops, self.chains, self.readers))
        return entry[1]
