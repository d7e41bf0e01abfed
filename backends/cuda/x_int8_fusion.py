"""x's int8 pass inside the kernel that writes x (issue 13): at a step of few rows the GGUF GEMV on int8 activations
(kernels_src/dequant_gemv_i8) quantizes x in a launch of its own (quantize_x) before each projection; where x comes
from add_rms_norm (qkv, gate_up) or the gated activation (down), kernels_src/x_int8's variants of those kernels write
the int8 codes and per-32 scales too, and the GEMVs reading x take them (no quantize_x launch; the codes are
quantize_x's of the same stored x, bit for bit, so the logits do not move).

`plan` finds once the producers whose output only linears over int8-path GGUF weights read; `produce` runs one
where the step's rows take the GEMV for every reader (gguf_linear.takes_gemv) and the int8 path for one at least
(dequant_gemv's TUNED may pick fp32 x for a problem: Llama-3-8B's Q6_K v, 1024 x 4096, at one row; that GEMV
reads x as before), and holds (x, xq, xd) on the plan; `prequantized` hands them to a linear that reads that very
tensor. The buffers are the step's own tensors, so a captured CUDA graph replays them as the other intermediates.

Off by default until an H200 has timed it (tools/bench_gpu's "x int8 fusion" ablation): the runner's
x_int8_fusion, None: LLM_ENGINE_X_INT8_FUSION=1 turns it on (read once, as LLM_ENGINE_FUSED_REDUCE).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from backends.cuda.gguf_linear import takes_gemv
from backends.cuda.weights import QuantWeight
from ir.graph import Graph
from kernels_src import dequant_gemv_i8, x_int8
from kernels_src.activations import ACTIVATIONS
from kernels_src.dequant_gemv import default_tiles

ENV = "LLM_ENGINE_X_INT8_FUSION"
DEFAULT = os.environ.get(ENV, "0") == "1"


@dataclass
class Plan:
    readers: dict[int, tuple] = field(default_factory=dict)  # id(producer) -> its readers' (qtype, N, K)
    held: tuple | None = None  # (x, xq, xd) of the producer that ran last

    def __contains__(self, node_id: int) -> bool:
        return node_id in self.readers


def enabled(flag: bool | None) -> bool:
    return DEFAULT if flag is None else bool(flag)


def plan(graph: Graph, params: dict) -> Plan:
    """Each add_rms_norm (offset 0 or 1) and gated node whose x only linears over int8-path GGUF weights read."""
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
        if all(_i8_weight(w) for w in weights):
            found.readers[id(node)] = tuple(sorted({(w.qtype.upper(), *w.shape) for w in weights}))
    return found


def _i8_weight(w) -> bool:
    return isinstance(w, QuantWeight) and w.qtype.upper() in dequant_gemv_i8.I8_QTYPES and w.data.dim() == 2


def produce(runner, node, args):
    """node's outputs through x_int8 (holding x's int8 form on the plan), or None where it does not apply: fusion
    off, or a step whose rows some reader runs elsewhere than the int8 GEMV (MMQ, the GEMMs, a target without it)."""
    if not enabled(runner.x_int8_fusion):
        return None
    x, target = args[0], runner.target
    rows = x.numel() // x.shape[-1]
    readers = runner.x_int8_plan.readers[id(node)]
    if x.dim() != 2 or x.shape[-1] % 32 or rows < 1 or not all(takes_gemv(rows, q, target) for q, _, _ in readers):
        return None
    if not any(_int8_gemv(rows, *r, target) for r in readers):
        return None
    if node.op == "add_rms_norm":
        s, out, xq, xd = x_int8.add_rms_norm_q8(x, args[1], args[2], node.attrs["eps"],
                                                offset=node.attrs["offset"] == 1.0, target=target, pdl=runner.pdl)
        result = (s, out)
    else:
        out, xq, xd = x_int8.gated_act_q8(args[0], args[1], node.attrs["act"], target=target, pdl=runner.pdl)
        result = out
    runner.x_int8_plan.held = (out, xq, xd)
    return result


def _int8_gemv(rows: int, qtype: str, n: int, k: int, target: str) -> bool:
    """Whether dequant_gemv runs this problem on int8 x (as it decides: its TUNED entry's int8_x on I8_TARGETS)."""
    tuned = default_tiles(qtype, rows, n, k).get("int8_x") if target in dequant_gemv_i8.I8_TARGETS else None
    return dequant_gemv_i8.uses_int8(qtype, target, tuned)


def prequantized(runner, x):
    """(xq, xd) where x is the tensor the last producer wrote, else None."""
    held = runner.x_int8_plan.held
    return held[1:] if held is not None and held[0] is x else None
