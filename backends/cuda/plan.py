"""What the CUDA lowering fuses, read off the IR graph once: no pattern here is model-specific.

- linear groups: linears that read the same input (q/k/v, gate/up) run as one GEMM over a concatenated weight;
- gated activations: act(gate) * up, when the activation's only use is that product, is one kernel;
- add + rms_norm: a residual add whose sum feeds an rms_norm is one kernel writing both;
- rope pairs: two ropes of the same spec and positions (q and k) are one in-place kernel (when the second's input
  is ready by the first: the runner checks);
- rope + KV write: an attention whose q and k come straight from such a pair, the rotated k read by nothing else,
  rotates q in place and writes the rotated k and v to the cache in one kernel (the runner may decline).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ir.graph import Graph, Node

GATED = ("silu", "gelu", "gelu_tanh")


@dataclass
class LinearGroup:
    name: str
    nodes: list[Node]
    weights: list[str]
    biases: list[str]  # empty, or one per weight
    sizes: list[int]  # output features of each part


@dataclass
class Plan:
    graph: Graph
    linear_groups: list[LinearGroup] = field(default_factory=list)
    group_of: dict[int, tuple[LinearGroup, int]] = field(default_factory=dict)  # linear's out id -> (group, part)
    other_uses: set[str] = field(default_factory=set)  # params some unfused node reads
    gated: dict[int, tuple[str, int]] = field(default_factory=dict)  # mul's out id -> (act, gate value id)
    folded: set[int] = field(default_factory=set)  # out ids of nodes computed inside another node's kernel
    add_norm: dict[int, Node] = field(default_factory=dict)  # add's out id -> the rms_norm it feeds
    rope_pair: dict[int, Node] = field(default_factory=dict)  # first rope's out id -> the second rope
    rope_kv: dict[int, tuple[Node, Node]] = field(default_factory=dict)  # attention's out id -> (q rope, k rope)
    rope_kv_ropes: set[int] = field(default_factory=set)  # out ids of those ropes: done by the attention's kernel
    uses: dict[int, list[Node]] = field(default_factory=lambda: defaultdict(list))  # value id -> nodes reading it

    @classmethod
    def build(cls, graph: Graph) -> Plan:
        plan = cls(graph)
        uses = plan.uses
        for node in graph.nodes:
            for v in node.inputs:
                if v is not None:
                    uses[v.id].append(node)
        plan._group_linears(graph)
        fused = {n.out.id for g in plan.linear_groups for n in g.nodes}
        for node in graph.nodes:
            if node.out.id not in fused:
                plan.other_uses.update(v.name for v in node.inputs if v is not None and v.kind == "param")
        for node in graph.nodes:
            if node.op in GATED and [(u.op, u.inputs[0].id) for u in uses[node.out.id]] == [("mul", node.out.id)]:
                plan.gated[uses[node.out.id][0].out.id] = (node.op, node.inputs[0].id)
                plan.folded.add(node.out.id)
            if node.op == "add":
                norms = [u for u in uses[node.out.id] if u.op == "rms_norm" and u.inputs[0].id == node.out.id
                         and u.attrs.get("offset", 0.0) in (0.0, 1.0)]
                if norms:
                    plan.add_norm[node.out.id] = norms[0]
                    plan.folded.add(norms[0].out.id)
        plan._pair_ropes(graph)
        plan._rope_into_attention(graph)
        return plan

    def _rope_into_attention(self, graph: Graph) -> None:
        made = {n.out.id: n for n in graph.nodes}
        for node in graph.nodes:
            if node.op != "attention":
                continue
            rq, rk = (made.get(v.id) for v in node.inputs[:2])
            if (rq is None or rk is None or rq.op != "rope" or rk.op != "rope" or rq is rk
                    or rq.attrs["spec"] != rk.attrs["spec"] or rq.inputs[1].id != rk.inputs[1].id
                    or self.uses[rk.out.id] != [node] or self.uses[rq.out.id] != [node]):
                continue
            self.rope_kv[node.out.id] = (rq, rk)
            self.rope_kv_ropes.update((rq.out.id, rk.out.id))

    def _group_linears(self, graph: Graph) -> None:
        by_input: dict[int, list[Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "linear" and node.inputs[1].kind == "param":
                by_input[node.inputs[0].id].append(node)
        for nodes in by_input.values():
            biases = [n.inputs[2] if len(n.inputs) > 2 else None for n in nodes]
            if len(nodes) < 2 or (any(b is None for b in biases) and any(b is not None for b in biases)):
                continue
            if any(b is not None and b.kind != "param" for b in biases):
                continue
            weights = [n.inputs[1].name for n in nodes]
            prefix = weights[0].rsplit(".", 1)[0] + "."
            name = "+".join(weights) if any(not w.startswith(prefix) for w in weights) else \
                prefix + "+".join(w[len(prefix):] for w in weights)
            group = LinearGroup(name, nodes, weights, [b.name for b in biases if b is not None],
                                [int(n.inputs[1].shape[0]) for n in nodes])
            self.linear_groups.append(group)
            for i, n in enumerate(nodes):
                self.group_of[n.out.id] = (group, i)

    def unfuse(self, group: LinearGroup) -> None:
        """The group's parts run one by one (their formats differ)."""
        self.linear_groups.remove(group)
        for n in group.nodes:
            self.group_of.pop(n.out.id, None)
        self.other_uses.update(group.weights + group.biases)

    def _pair_ropes(self, graph: Graph) -> None:
        ropes = [n for n in graph.nodes if n.op == "rope"]
        taken: set[int] = set()
        for i, a in enumerate(ropes):
            if a.out.id in taken:
                continue
            for b in ropes[i + 1:]:
                if (b.out.id not in taken and b.attrs["spec"] == a.attrs["spec"] and b.inputs[1].id == a.inputs[1].id
                        and b.inputs[0].id != a.inputs[0].id):
                    self.rope_pair[a.out.id] = b
                    taken.update((a.out.id, b.out.id))
                    break

    def in_place_ok(self, value_id: int) -> bool:
        """Whether a rope may rotate its input in place: nothing but that rope reads it."""
        return len(self.uses.get(value_id, ())) == 1
