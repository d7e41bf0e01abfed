"""In-situ quantization (`--isq TYPE`): a model's matrices quantized at load into a GGUF block format, so every
backend takes them as it takes a GGUF file's.

What is quantized follows llama.cpp's `llama-quantize` for a plain type (src/llama-quant.cpp):
- every linear's matrix and every MoE expert stack: TYPE;
- the untied token embedding: TYPE (llama-quantize leaves token_embd at the base type for plain types);
- the LM head, and a tied embedding (one tensor for both): Q6_K, or Q8_0 when TYPE is Q8_0 or the row length is not
  a whole number of TYPE's blocks (llama.cpp's output-tensor rule);
- kept as stored: norms, biases, every 1-D tensor, MoE routers (a linear feeding moe_route: ffn_gate_inp) and the
  shared-expert gate (one output row: ffn_gate_inp_shexp), and MLA's per-head head_linear stacks (attn_k_b/v_b).
A row length that is not a whole number of blocks falls back as llama.cpp's tensor_type_fallback does: Q2_K and
Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and where even that does not fit the tensor stays as stored
(llama.cpp writes F16). Unlike llama-quantize's Q*_K_S/M mixes, TYPE is not raised for some layers."""

from __future__ import annotations

import logging
from collections import defaultdict
from math import prod

from tqdm.auto import tqdm

from ir.formats.gguf_quantize import quantize
from ir.formats.gguf_quants import QTYPES
from ir.graph import Graph
from ir.ops import OPS
from ir.weights import StoredTensor, WeightStore

log = logging.getLogger(__name__)

ISQ_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
             "q2k": "Q2_K", "q3k": "Q3_K", "q4k": "Q4_K", "q5k": "Q5_K", "q6k": "Q6_K"}
# Values of --isq that candle-vllm takes and that wait for formats of their own here.
_WAITING = {"int4": "the GPTQ/AWQ int4 weight format", "fp8": "the FP8 weight format"}
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def isq_kind(name: str) -> str:
    """The GGUF type an --isq value names ("q4k" -> "Q4_K"), or ValueError saying what is accepted."""
    key = name.strip().lower()
    if key in _WAITING:
        raise ValueError(f"--isq {key} is not built yet: it waits for {_WAITING[key]}; in-situ quantization takes "
                         f"{', '.join(ISQ_TYPES)}")
    if key not in ISQ_TYPES:
        raise ValueError(f"unknown --isq type {name!r}; expected one of {', '.join(ISQ_TYPES)}")
    return ISQ_TYPES[key]


def _fits(kind: str, n: int) -> bool:
    return n % QTYPES[kind].block_size == 0


def target_kind(kind: str, role: str, n: int) -> str | None:
    """The type a matrix of `role` ("matrix", "embed" or "head") with rows of n values gets under --isq kind, after
    llama.cpp's fallback; None where no block type fits (the tensor stays as stored)."""
    if role == "head":
        kind = "Q8_0" if kind == "Q8_0" or not _fits(kind, n) else "Q6_K"
    if not _fits(kind, n):
        kind = _FALLBACK.get(kind, kind)
    return kind if _fits(kind, n) else None


def roles(graph: Graph) -> dict[str, str]:
    """Parameter -> "matrix", "embed" or "head" for every parameter --isq quantizes (the rest stay as stored)."""
    feeds: dict[int, set[str]] = defaultdict(set)  # value id -> ops that read it
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None:
                feeds[v.id].add(node.op)
    out: dict[str, str] = {}
    tables = {n.inputs[0].name for n in graph.nodes if n.op == "embedding"}
    for node in graph.nodes:
        for i in OPS[node.op].weights:
            w = node.inputs[i]
            if w is None or w.kind != "param":
                continue
            p = graph.params[w.name]
            if node.op == "embedding":
                out.setdefault(p.name, "embed")
            elif node.op == "linear":
                if "moe_route" in feeds[node.out.id] or p.shape[0] == 1:
                    continue  # a router or a shared-expert gate: llama-quantize keeps ffn_gate_inp* as they are
                out[p.name] = "head" if p.name == "lm_head" or p.name in tables else "matrix"
            else:
                out[p.name] = "matrix"  # an MoE expert stack
    return out


def quantize_weights(graph: Graph, store: WeightStore, isq: str, progress: bool = True) -> None:
    """Replace `store`'s matrices with --isq `isq`'s GGUF blocks, in place (see the module docstring for which)."""
    kind = isq_kind(isq)
    plan = {}
    fallbacks: dict[tuple[str, int, str | None], list[str]] = defaultdict(list)
    requantized: list[str] = []
    for name, role in roles(graph).items():
        t = store[name]
        n = t.shape[-1]
        want = target_kind(kind, role, n)
        if role == "head":
            log.info("isq %s: the LM head (%s) as %s, llama-quantize's choice for output.weight", kind, name, want)
        elif want != kind:
            fallbacks[(kind, n, want)].append(name)
        if want is None or t.kind == want:
            continue
        if t.quantized:
            requantized.append(f"{name} ({t.kind})")
        plan[name] = want
    for (k, n, to), names in fallbacks.items():
        log.warning("isq %s: %d matri%s with rows of %d values (not a whole number of %d-value blocks) %s, as "
                    "llama.cpp's llama-quantize does: %s", k, len(names), "x" if len(names) == 1 else "ces", n,
                    QTYPES[k].block_size, f"fall back to {to}" if to else "stay as stored (llama.cpp: F16)",
                    ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))
    if requantized:
        log.warning("isq %s: %d GGUF-quantized tensor(s) dequantized and quantized again (error adds up): %s", kind,
                    len(requantized), ", ".join(requantized[:6]) + (", ..." if len(requantized) > 6 else ""))
    total = sum(prod(store[p].shape) for p in plan)
    with tqdm(total=total, desc=f"isq {kind}", unit="weight", unit_scale=True, disable=not progress,
              leave=False) as bar:
        for name, want in plan.items():
            t = store[name]
            blocks = quantize(t.values().reshape(t.shape), want)
            store[name] = StoredTensor(blocks, want, t.shape, t.source)
            bar.update(prod(t.shape))
    log.info("isq %s: %d tensor(s) quantized (%s)", kind, len(plan),
             ", ".join(f"{k} {sum(1 for v in plan.values() if v == k)}" for k in sorted(set(plan.values()))))

