"""x's int8 pass inside the kernel that writes x (issue 13): at a step of few rows the GGUF GEMV on int8 activations
(kernels_src/dequant_gemv_i8) quantizes x in a launch of its own (quantize_x) before each projection; where x comes
from add_rms_norm (qkv, gate_up) or the gated activation (down), kernels_src/x_int8's variants of those kernels write
the int8 codes and per-32 scales too, and the GEMV reads them (no quantize_x launch).

`plan` finds once the producers whose output only linears over int8-path GGUF weights read; `produce` runs one
where the step's rows take the GEMV (1 .. below MMQ_MIN_ROWS / GEMV_MAX_ROWS) and remembers (x, xq, xd) on the
runner; `prequantized` hands them to the linear that reads that very tensor. The buffers are the step's own
tensors, so a captured CUDA graph replays them as the other intermediates. LLM_ENGINE_X_INT8_FUSION=0: off.
"""

from __future__ import annotations

import os

from backends.cuda.weights import QuantWeight
from ir.graph import Graph
from kernels_src import x_int8
from kernels_src.activations import ACTIVATIONS
from kernels_src.dequant_gemv_i8 import I8_DEFAULT

ENV = "LLM_ENGINE_X_INT8_FUSION"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def plan(graph: Graph, params: dict) -> set[int]:
    """id(node) of each add_rms_norm (offset 0 or 1) and gated node whose x is read by GGUF int8-path linears only."""
    uses, outputs = graph.uses(), {v.id for v in graph.outputs.values()}
    found = set()
    for node in graph.nodes:
        if node.op == "add_rms_norm":
            ok = node.attrs.get("offset", 0.0) in (0.0, 1.0)
        else:
            ok = node.op == "gated" and node.attrs["act"] in ACTIVATIONS
        x = node.outs[-1]
        readers = uses.get(x.id, [])
        if not ok or not readers or x.id in outputs:
            continue
        if all(r.op == "linear" and r.inputs[0].id == x.id and _i8_weight(params.get(r.inputs[1].name))
               for r in readers):
            found.add(id(node))
    return found


def _i8_weight(w) -> bool:
    return isinstance(w, QuantWeight) and w.qtype.upper() in I8_DEFAULT and w.data.dim() == 2


def produce(runner, node, args, gemv_rows: int):
    """node's outputs through x_int8 (remembering x's int8 form on the runner), or None where it does not apply:
    the runner says below how many rows its linears take the int8 GEMV (0: none, a target without it)."""
    x = args[0]
    rows = x.numel() // x.shape[-1]
    if not 1 <= rows < gemv_rows or x.shape[-1] % 32 or x.dim() != 2:
        return None
    if node.op == "add_rms_norm":
        s, out, xq, xd = x_int8.add_rms_norm_q8(x, args[1], args[2], node.attrs["eps"],
                                                offset=node.attrs["offset"] == 1.0, target=runner.target,
                                                pdl=runner.pdl)
        result = (s, out)
    else:
        out, xq, xd = x_int8.gated_act_q8(args[0], args[1], node.attrs["act"], target=runner.target, pdl=runner.pdl)
        result = out
    runner.x_int8 = (out, xq, xd)
    return result


def prequantized(runner, x):
    """(xq, xd) where x is the tensor the last producer wrote, else None."""
    held = getattr(runner, "x_int8", None)
    return held[1:] if held is not None and held[0] is x else None
