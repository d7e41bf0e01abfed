"""x's int8 pass inside the kernel that writes x (issues 13, 17): at a step of few rows the GEMVs on int8 activations
quantize x in a launch of their own before each projection (GGUF's dequant_gemv_i8: quantize_x, per 32 inputs; the
integer groups' int_group_gemv_i8, GPTQ / AWQ: quantize_x_i8, per q word's inputs with sums); where x comes from
add_rms_norm (qkv, gate_up) or the gated activation (down), a variant of that kernel writes x's int8 form too
(kernels_src/x_int8 for GGUF, kernels_src/x_int8_groups for integer groups), and the GEMVs reading x take it: the
same arrays, bit for bit, with no launch of their own, so the logits do not move.

`plan` finds once the producers whose output only linears of one kind read (GGUF blocks with an int8 path, or
integer groups of one (bits, group) without an act-order permutation); `produce` runs one where the step's rows
take one int8 layout for every reader, and holds x and its int8 form on the plan; `prequantized` hands them to a
linear that reads that very tensor. The layouts (`_route`): the GGUF GEMV's (every reader on it, the int8 path for
one at least: dequant_gemv's TUNED may pick fp32 x for a problem, Llama-3-8B's Q6_K v, 1024 x 4096, at one row; that
GEMV reads x as before), the GGUF MMQ's per256 pre-pass (4-32 rows, one of its two layouts for every reader), the
integer-group GEMV's and the integer-group GEMM's (9-128 rows, every reader on its variant mmq). The buffers are
the step's own tensors, so a captured CUDA graph replays them as the other intermediates.

On by default: on the H200 (2026-12-04, docs/BENCHMARKS.md) it took Llama-3-8B decode at batch 1 from 398 to
432 tok/s in Q4_K_M and from 432 to 468 in int4 (tools/bench_gpu), and the Q4_K_M file from 397 to 430 tok/s
(tools/bench_gguf). The runner's x_int8_fusion, None: LLM_ENGINE_X_INT8_FUSION (read once; 0 turns it off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from backends.cuda.gguf_linear import takes_gemv, takes_mmq
from backends.cuda.int_group_linear import GEMM_ROWS as INT_GROUP_GEMM_ROWS
from backends.cuda.weights import QuantWeight
from ir.graph import Graph
from ir.weight_formats import weight_format
from kernels_src import dequant_gemv_i8, int_group_gemv_i8, x_int8, x_int8_groups
from kernels_src.activations import ACTIVATIONS
from kernels_src.dequant_gemv import default_tiles
from kernels_src.gguf_mmq import x_layout
from kernels_src.int_group_gemm import tuned_variant
from kernels_src.int_group_gemv import MAX_ROWS as INT_GROUP_GEMV_ROWS
from kernels_src.int_group_mmq import mmq_step

ENV = "LLM_ENGINE_X_INT8_FUSION"
DEFAULT = os.environ.get(ENV, "1") != "0"


@dataclass
class Plan:
    # id(producer) -> ("gguf", its readers' (qtype, N, K)) or ("intgroup", (bits, group, its readers' (N, K)))
    readers: dict[int, tuple] = field(default_factory=dict)
    held: tuple | None = None  # (x, its int8 arrays) of the producer that ran last
    # (producer, rows, the runner's settings) -> _route's answer: asked once, not at every eager step's every layer
    routes: dict[tuple, tuple | None] = field(default_factory=dict)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self.readers


def enabled(flag: bool | None) -> bool:
    return DEFAULT if flag is None else bool(flag)


def plan(graph: Graph, params: dict) -> Plan:
    """Each add_rms_norm (offset 0 or 1) and gated node whose x only linears of one int8-path kind read."""
    uses, outputs = graph.uses(), {v.id for v in graph.outputs.values()}
    found = Plan()
    for node in graph.nodes:
        if node.op == "add_rms_norm":
            ok = node.attrs.get("offset", 0.0) in (0.0, 1.0)  # the kernel knows w and 1 + w only
        else:
            ok = node.op == "gated" and node.attrs["act"] in ACTIVATIONS
        x = node.outs[-1]
        readers = uses.get(x.id, [])
        if not ok or not readers or x.id in outputs:
            continue
        weights = [params.get(r.inputs[1].name) if r.op == "linear" and r.inputs[0].id == x.id else None
                   for r in readers]
        kinds = {_kind(w) for w in weights}
        if len(kinds) == 1 and None not in kinds:
            kind = kinds.pop()
            shapes = tuple(sorted({tuple(w.shape) for w in weights}))
            found.readers[id(node)] = (kind[0], tuple(sorted({(w.qtype.upper(), *w.shape) for w in weights}))
                                       if kind[0] == "gguf" else (*kind[1], shapes))
    return found


def _kind(w) -> tuple | None:
    """("gguf",) for GGUF blocks with an int8 GEMV, ("intgroup", (bits, group)) for unpermuted integer groups."""
    if not isinstance(w, QuantWeight) or w.data.dim() != 2:
        return None
    if w.qtype.upper() in dequant_gemv_i8.I8_QTYPES:
        return ("gguf",)
    fmt = weight_format(w.qtype)
    return ("intgroup", fmt.int_group) if fmt.family == "intgroup" and w.perm is None else None


def produce(runner, node, args):
    """node's outputs through x_int8 / x_int8_groups (holding x's int8 form on the plan), or None where it does not
    apply: fusion off, or a step whose rows some reader runs elsewhere than the int8 kernels one layout serves."""
    if not enabled(runner.x_int8_fusion):
        return None
    x = args[0]
    rows = x.numel() // x.shape[-1]
    kind, what = runner.x_int8_plan.readers[id(node)]
    if x.dim() != 2 or rows < 1:
        return None
    key = (id(node), rows, runner.target, runner.mmq_variant, runner.mmq_max_rows)
    fused = runner.x_int8_plan
    if key not in fused.routes:
        fused.routes[key] = _route(runner, kind, what, rows, x.shape[-1])
    if fused.routes[key] is None:
        return None
    how, pos, kw = fused.routes[key]
    kw = dict(kw, target=runner.target, pdl=runner.pdl)
    norm_fn, act_fn = {"q8": (x_int8.add_rms_norm_q8, x_int8.gated_act_q8),
                       "i8g": (x_int8_groups.add_rms_norm_i8g, x_int8_groups.gated_act_i8g),
                       "mmq": (x_int8_groups.add_rms_norm_mmq, x_int8_groups.gated_act_mmq)}[how]
    if node.op == "add_rms_norm":
        s, out, *arrays = norm_fn(x, args[1], args[2], node.attrs["eps"], *pos, offset=node.attrs["offset"] == 1.0,
                                  **kw)
    else:
        out, *arrays = act_fn(args[0], args[1], node.attrs["act"], *pos, **kw)
    # the GEMV's (xq, xd) come flat; the other layouts as one tuple: (xq, xd, xs) (per256), quantize_x_i8's four,
    # (xq, xs) (the integer-group GEMM's)
    fused.held = (out, tuple(arrays[0] if len(arrays) == 1 else arrays))
    return (s, out) if node.op == "add_rms_norm" else out


def _route(runner, kind: str, what: tuple, rows: int, k: int) -> tuple | None:
    """(kernels, their positional and keyword extras) writing the layout every reader of x takes at `rows`, or
    None: "q8" (the GGUF GEMV's per 32, or the MMQ's per256), "i8g" (the integer-group GEMV's) or "mmq" (its GEMM's)."""
    target = runner.target
    if kind == "gguf":
        if _gguf_takes(rows, what, target):
            return "q8", (), {}
        layout = _mmq_layout(runner, rows, what)
        return None if layout is None else ("q8", (), dict(group=256, split=layout == "per256-split"))
    bits, group, shapes = what
    if _int_group_takes(rows, k, bits, group, target):
        return "i8g", (bits, group), {}
    step = _int_group_mmq_step(rows, bits, group, shapes)
    return None if step is None else ("mmq", (bits, step), {})


def _gguf_takes(rows: int, readers: tuple, target: str) -> bool:
    """Every reader on the GEMV (gguf_linear.takes_gemv), one at least on int8 x; K a multiple of 32."""
    return (all(takes_gemv(rows, q, target) and k % 32 == 0 for q, _, k in readers)
            and any(_int8_gemv(rows, *r, target) for r in readers))


def _mmq_layout(runner, rows: int, readers: tuple) -> str | None:
    """Where every reader runs the MMQ (gguf_linear's rows for it) on x's per256 pre-pass of one layout: that layout
    ("per256" or "per256-split"), else None (per32's pre-pass, with its sums, is not fused)."""
    if not all(takes_mmq(rows, q, runner.target, runner.mmq_max_rows) and k % 256 == 0 for q, _, k in readers):
        return None
    layouts = {x_layout(q, rows, n, k, runner.mmq_variant) for q, n, k in readers}
    return layouts.pop() if len(layouts) == 1 and layouts <= {"per256", "per256-split"} else None


def _int8_gemv(rows: int, qtype: str, n: int, k: int, target: str) -> bool:
    """Whether dequant_gemv runs this problem on int8 x (as it decides: its TUNED entry's int8_x on I8_TARGETS)."""
    tuned = default_tiles(qtype, rows, n, k).get("int8_x") if target in dequant_gemv_i8.I8_TARGETS else None
    return dequant_gemv_i8.uses_int8(qtype, target, tuned)


def _int_group_mmq_step(rows: int, bits: int, group: int, shapes: tuple) -> int | None:
    """The integer-group GEMM's step where int_group_linear runs every reader on it in variant mmq, else None."""
    if not INT_GROUP_GEMV_ROWS < rows <= INT_GROUP_GEMM_ROWS:
        return None
    steps = {mmq_step(bits, group, k) for _, k in shapes}
    if len(steps) != 1 or None in steps or any(tuned_variant(rows, n, k, bits, group) != "mmq" for n, k in shapes):
        return None
    return steps.pop()


def _int_group_takes(rows: int, k: int, bits: int, group: int, target: str) -> bool:
    """int_group_linear's GEMV rows, on int8 x (int_group_gemv_i8.uses_int8); K whole groups."""
    return rows <= INT_GROUP_GEMV_ROWS and int_group_gemv_i8.uses_int8(target) and k % group == 0


def prequantized(runner, x):
    """x's int8 arrays where x is the tensor the last producer wrote, else None."""
    held = runner.x_int8_plan.held
    return held[1] if held is not None and held[0] is x else None
