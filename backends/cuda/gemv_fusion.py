"""A step's linears over dense fp16/bf16 weights through kernels_src/dense_gemv where the step has at most 8 rows,
with the op before each (and the residual add after it) run inside the GEMV (and which wider steps' linears
kernels_src/dense_gemm takes: dense_gemm_takes).

The fused graph (ir.fusion) puts each projection right after what makes its input: rms_norm -> linear (the first
layer's qkv), add_rms_norm -> linear (qkv and gate_up: the normed result goes to the linear, the sum on down the
residual stream), gated -> linear (down). `plan` finds those pairs once, where the linear is the only reader of the
value between them, and a linear whose result only the next node, an add, reads (the residual epilogue, e.g. with
ir.fusion's add_norm off). The pairs are adjacent nodes, so a piecewise graph (backends/cuda/piecewise.py), which
cuts between nodes and runs whole pieces, never splits one: a chain runs only when all of it is in the node list.
Whether to fuse depends on the step's rows (the GEMV takes 1-8), so `run` decides each step and says how many
nodes it ran (0: run them one by one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.cuda.runtime import torch
from ir.graph import Graph, Node
from kernels_src import dense_gemm as dgm
from kernels_src import dense_gemv as dg

DTYPES = (torch.float16, torch.bfloat16)  # weights the GEMV streams (a CPU test adds fp32)
PROLOGUES = ("rms_norm", "add_rms_norm", "gated")


def gemv_weight(w) -> bool:
    """Whether a linear's parameter is a matrix dense_gemv reads: dense, of DTYPES, rows contiguous."""
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in DTYPES and w.stride(1) == 1


def gemv_rows(x, max_rows: int = dg.MAX_ROWS) -> int | None:
    """x's rows where the GEMV may take them (1 to max_rows, at most the kernel's 8; x of DTYPES or fp32), else None."""
    if x.dim() < 1 or x.dtype not in (*DTYPES, torch.float32) or x.shape[-1] == 0:
        return None
    rows = x.numel() // x.shape[-1]
    return rows if 1 <= rows <= min(max_rows, dg.MAX_ROWS) else None


def dense_gemm_takes(x, w) -> bool:
    """Whether dense_gemm runs x @ w.T: a matrix gemv_weight takes, x of its dtype, and a table entry for the
    problem (its row bucket, N, K): with an empty table every linear stays on cuBLAS."""
    if not gemv_weight(w) or x.dtype != w.dtype or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        return False
    return bool(dgm.tuned(x.numel() // max(1, x.shape[-1]), w.shape[0], w.shape[1]))


def _ref(v) -> tuple:
    """Where run finds a value: (True, its id) in the step's values, (False, its name) among the parameters."""
    return (False, v.name) if v.kind == "param" else (True, v.id)


@dataclass(frozen=True)
class Chain:
    """[prologue] linear [add]: nodes that run as one dense_gemv. The rest is what `run` reads and writes, worked
    out once (an eager decode step runs three chains a layer)."""

    prologue: Node | None
    linear: Node
    add: Node | None
    nodes: tuple[Node, ...] = field(init=False, repr=False)
    ins: tuple = field(init=False, repr=False)  # the prologue's inputs (the linear's x without one), as _ref gives
    weight: str = field(init=False, repr=False)
    bias: tuple | None = field(init=False, repr=False)  # _ref of the linear's bias
    addend: int | None = field(init=False, repr=False)  # the residual epilogue's value
    sum_out: int | None = field(init=False, repr=False)  # add_rms_norm's sum: a value of its own
    out: int = field(init=False, repr=False)
    make: object = field(init=False, repr=False)  # (ins' tensors, add_rms_norm's sum_out) -> dense_gemv's prologue

    def __post_init__(self):
        lin, pro, b = self.linear, self.prologue, self.linear.inputs[2] if len(self.linear.inputs) > 2 else None
        for name, value in (
                ("make", _maker(pro)),
                ("nodes", tuple(n for n in (pro, lin, self.add) if n is not None)),
                ("ins", tuple(_ref(v) for v in (pro.inputs if pro is not None else lin.inputs[:1]))),
                ("weight", lin.inputs[1].name), ("bias", None if b is None else _ref(b)),
                ("addend", None if self.add is None else _addend(self.add, lin).id),
                ("sum_out", pro.outs[0].id if pro is not None and pro.op == "add_rms_norm" else None),
                ("out", (self.add or lin).out.id)):
            object.__setattr__(self, name, value)


def _maker(pro: Node | None):
    """dense_gemv's prologue from its node's arguments, the node's attributes read once."""
    if pro is None:
        return None
    eps, offset = pro.attrs.get("eps"), pro.attrs.get("offset") == 1.0
    if pro.op == "gated":
        act = pro.attrs["act"]
        return lambda a, s: dg.Gated(act, a[1])
    if pro.op == "rms_norm":
        return lambda a, s: dg.RMSNorm(a[1], eps, offset)
    return lambda a, s: dg.AddRMSNorm(a[1], a[2], eps, offset, s)  # its sum `s` a value of its own (the residual)


def _fusable_prologue(node: Node) -> bool:
    if node.op == "gated":
        return node.attrs["act"] in dg.ACTIVATIONS
    return node.op in ("rms_norm", "add_rms_norm") and node.attrs.get("offset", 0.0) in (0.0, 1.0)


def plan(graph: Graph, params: dict) -> dict[int, Chain]:
    """id(a chain's first node) -> the chain, for every linear over a dense matrix that has something to fuse."""
    uses, outputs = graph.uses(), {v.id for v in graph.outputs.values()}
    sole = lambda v, node: v.id not in outputs and uses.get(v.id, []) == [node]
    nodes, chains = graph.nodes, {}
    for i, lin in enumerate(nodes):
        w = lin.inputs[1] if lin.op == "linear" else None
        if w is None or w.kind != "param" or not gemv_weight(params.get(w.name)):
            continue
        pro = nodes[i - 1] if i > 0 else None
        fed = pro is not None and _fusable_prologue(pro) and lin.inputs[0].id == pro.outs[-1].id
        pro = pro if fed and sole(lin.inputs[0], lin) else None
        add = nodes[i + 1] if i + 1 < len(nodes) else None
        has_bias = len(lin.inputs) > 2 and lin.inputs[2] is not None
        if add is None or add.op != "add" or has_bias or not sole(lin.out, add) or _addend(add, lin) is None:
            add = None
        if pro is not None or add is not None:
            chains[id(pro or lin)] = Chain(pro, lin, add)
    return chains


def _addend(add: Node, lin: Node):
    """The add's other input where it is the residual epilogue's [rows, N] (no broadcast, not a parameter)."""
    a, b = add.inputs
    other = b if a.id == lin.out.id else a if b.id == lin.out.id else None
    return other if other is not None and other.kind != "param" and other.shape == lin.out.shape else None


def run(chain: Chain, env: dict, runner) -> int:
    """Run `chain` as one dense_gemv when the step's rows allow: the nodes it ran, or 0 (run them one by one). The
    caller checks that its node list holds the whole chain from here (node_steps: a piece may end inside it)."""
    params, arena = runner.params, runner.step_arena
    args = [env[k] if here else params[k] for here, k in chain.ins]
    residual = env[chain.addend] if chain.addend is not None else None
    w = params[chain.weight]
    if arena is not None and (memo := arena.memo.get(id(chain))) is not None and memo[0] is w and \
            memo[1] is residual and _same(memo[2], args):  # the arrays of its last launch: launch it again
        memo[3](*memo[4])
        if chain.sum_out is not None:
            env[chain.sum_out], env[chain.out] = memo[5]
        else:
            env[chain.out] = memo[5]
        return len(chain.nodes)
    x = args[0]
    if len(x.shape) != 2 or gemv_rows(x, runner.gemv_max_rows) is None:
        return 0
    if residual is not None and residual.stride(-1) != 1:
        return 0
    if arena is not None and chain.bias is None:  # an eager decode step's: its kept buffers (step_arena)
        out = arena.take(chain.out, (x.shape[0], w.shape[0]), x)
        s = None if chain.sum_out is None else arena.take(chain.sum_out, x.shape, x)
        prologue = None if chain.make is None else chain.make(args, s)
        y, again = dg.launched(x, w, prologue=prologue, residual=residual, out=out, target=runner.target,
                               pdl=runner.pdl)
        if again is not None and arena.holds(chain.out, out) and (s is None or arena.holds(chain.sum_out, s)):
            arena.memo[id(chain)] = (w, residual, args, *again, y)
    else:
        y = dg.dense_gemv(x, w, prologue=None if chain.make is None else chain.make(args, None), residual=residual,
                          target=runner.target, pdl=runner.pdl)
    if chain.sum_out is not None:  # add_rms_norm's (sum, y)
        env[chain.sum_out], y = y
    if chain.bias is not None:
        here, k = chain.bias
        y = y + (env[k] if here else params[k])
    env[chain.out] = y
    return len(chain.nodes)


def _same(kept: list, args: list) -> bool:
    """Whether `args` are the tensors `kept` holds, one by one (the same objects: the same addresses and shapes)."""
    for a, b in zip(kept, args, strict=True):
        if a is not b:
            return False
    return True
