"""The tensor IR: typed values, nodes, parameters and a graph builder with shape inference.

A graph describes one forward step over a flat varlen batch (see `core.batch`): every backend lowers
the same graph, and `ir.interpreter` defines what it computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ir.ops import OPS, Dim, TensorType

__all__ = ["Graph", "Node", "Param", "TensorType", "Value"]


@dataclass(eq=False)
class Value:
    """An SSA value: a graph input, a parameter reference or a node's result."""

    id: int
    type: TensorType
    kind: str  # "input" | "param" | "node"
    name: str | None = None

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    def ref(self) -> str:
        return f"@{self.name}" if self.kind == "param" else f"%{self.name or self.id}"


@dataclass(eq=False)
class Node:
    """One op applied to its inputs. Most ops have one result; a fused op (ir.fusion) may have several, each a
    value of its own (`outs`), so that every consumer still reads one value."""

    op: str
    inputs: tuple[Value | None, ...]
    attrs: dict[str, Any]
    outs: tuple[Value, ...]

    @property
    def out(self) -> Value:
        return self.outs[0]


@dataclass
class Param:
    """A weight the graph reads. `shard` annotates tensor-parallel splitting: "column" splits the
    output rows, "row" splits the input columns, "heads" the first dim of a per-head stack (head_linear's),
    None replicates."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: str | None = None
    # A parameter the fusion pass made: these parameters' rows, concatenated (q, k and v as one matrix).
    parts: tuple[str, ...] = ()
    # A rank's shard (ir.sharding): (axis, start, stop) of the whole parameter along that axis; None: all of it.
    cut: tuple[int, int, int] | None = None


@dataclass(eq=False)
class Graph:
    name: str
    dtype: str = "f32"
    inputs: dict[str, Value] = field(default_factory=dict)
    params: dict[str, Param] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: dict[str, Value] = field(default_factory=dict)
    _param_values: dict[str, Value] = field(default_factory=dict)
    _next_id: int = 0

    def _new_value(self, type_: TensorType, kind: str, name: str | None = None) -> Value:
        v = Value(self._next_id, type_, kind, name)
        self._next_id += 1
        return v

    def input(self, name: str, shape: tuple[Dim, ...], dtype: str) -> Value:
        if name in self.inputs:
            return self.inputs[name]
        v = self._new_value(TensorType(tuple(shape), dtype), "input", name)
        self.inputs[name] = v
        return v

    def param(self, name: str, shape: tuple[int, ...], dtype: str | None = None,
              shard: str | None = None) -> Value:
        """Declare (or reuse, e.g. for tied embeddings) a parameter."""
        if name in self.params:
            p = self.params[name]
            if p.shape != tuple(shape):
                raise ValueError(f"parameter {name} redeclared with shape {shape}, was {p.shape}")
            return self._param_values[name]
        p = Param(name, tuple(int(s) for s in shape), dtype or self.dtype, shard)
        self.params[name] = p
        v = self._new_value(TensorType(p.shape, p.dtype), "param", name)
        self._param_values[name] = v
        return v

    def matrix_params(self) -> set[str]:
        """Parameters read where an op declares a weight operand (a linear's weight, an embedding table, of any
        rank): the ones a backend may keep in a quantized format."""
        out = set()
        for node in self.nodes:
            for i in OPS[node.op].weights:
                w = node.inputs[i] if i < len(node.inputs) else None
                if w is not None and w.kind == "param":
                    out.add(w.name)
        return out

    def output(self, name: str, value: Value) -> None:
        self.outputs[name] = value

    @property
    def result(self) -> str:
        """The name of what a step returns: "logits", or an embedding model's final "hidden" states (ir.pooling)."""
        return "hidden" if "hidden" in self.outputs else "logits"

    def op(self, op: str, *inputs: Value | None, **attrs: Any) -> Value | tuple[Value, ...]:
        """Append a node; its result type comes from the op's shape and dtype inference (a tuple of values for an
        op with several results)."""
        if op not in OPS:
            raise KeyError(f"unknown IR op {op!r}")
        try:
            out_type = OPS[op].infer([i.type if i is not None else None for i in inputs], attrs)
        except (ValueError, IndexError) as e:
            shapes = ", ".join(str(i.type) if i is not None else "None" for i in inputs)
            raise ValueError(f"{op}({shapes}) {attrs}: {e}") from e
        types = out_type if isinstance(out_type, tuple) else (out_type,)
        outs = tuple(self._new_value(t, "node") for t in types)
        self.nodes.append(Node(op, tuple(inputs), dict(attrs), outs))
        return outs if isinstance(out_type, tuple) else outs[0]

    def uses(self) -> dict[int, list[Node]]:
        """Value id -> the nodes that read it (in graph order); graph outputs are not counted."""
        out: dict[int, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                if v is not None:
                    out.setdefault(v.id, []).append(node)
        return out

    def last_reads(self) -> dict[int, list[int]]:
        """id(node) -> the values (ids) that node is the last to read, params and the graph's inputs and outputs
        aside: where a runner may let go of them (an eager step otherwise holds every layer's activations)."""
        keep = {v.id for v in self.outputs.values()} | {v.id for v in self.inputs.values()}
        last: dict[int, Node] = {}
        for node in self.nodes:
            for v in node.inputs:
                if v is not None and v.kind != "param" and v.id not in keep:
                    last[v.id] = node
        out: dict[int, list[int]] = {}
        for vid, node in last.items():
            out.setdefault(id(node), []).append(vid)
        return out

    def attention_nodes(self) -> list[Node]:
        """The nodes that read and write a layer's KV cache, in layer order."""
        return [n for n in self.nodes if OPS[n.op].kv_cache]

    def rope_specs(self) -> list:
        """Every rope spec some node applies (a rope, a fused rope pair or an attention that rotates q and k)."""
        specs = {n.attrs["spec"]: None for n in self.nodes if "spec" in n.attrs}
        return list(specs)

    def __getattr__(self, op: str):
        # g.linear(x, w) == g.op("linear", x, w): the builder API is the op table itself.
        if op in OPS:
            return lambda *inputs, **attrs: self.op(op, *inputs, **attrs)
        raise AttributeError(op)
