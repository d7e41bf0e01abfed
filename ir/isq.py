"""In-situ quantization (`--isq TYPE`): a model's matrices quantized at load into a GGUF block format (or, for int4
and fp8, the integer-group and FP8 formats), so every backend takes them as it takes a GGUF file's (or a GPTQ or FP8
checkpoint's).

What is quantized follows llama.cpp's `llama-quantize` for a plain type (src/llama-quant.cpp):
- every linear's matrix and every MoE expert stack: TYPE;
- the untied token embedding: TYPE (llama-quantize leaves token_embd at the base type for plain types);
- the LM head, and a tied embedding (one tensor for both): Q6_K, or Q8_0 when TYPE is Q8_0 or the row length is not
  a whole number of TYPE's blocks (llama.cpp's output-tensor rule);
- kept as stored: norms, biases, every 1-D tensor, MoE routers (a linear feeding moe_route: ffn_gate_inp) and the
  shared-expert gate (one output row: ffn_gate_inp_shexp), and MLA's per-head head_linear stacks (attn_k_b/v_b).
A row length that is not a whole number of blocks falls back as llama.cpp's tensor_type_fallback does: Q2_K and
Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and where even that does not fit the tensor stays as stored
(llama.cpp writes F16). Unlike llama-quantize's Q*_K_S/M mixes, TYPE is not raised for some layers.

`int4` and `fp8` quantize the same matrices and expert stacks into the engine's own formats instead:
- int4: intgroup blocks (ir/formats/int_groups.py), 4-bit round-to-nearest, asymmetric, groups of 128 inputs, or 64
  or 32 where a row is no whole group of 128 (or 64); a row of no whole group of 32 stays as stored;
- fp8: e4m3 with one scale per 128x128 block (DeepSeek-V3's convention), the fp8 family (ir/formats/fp8_blocks.py);
  a row whose length shares fewer than 16 inputs with 128 stays as stored.
Both keep the LM head and the embedding (tied or not) as stored, as GPTQ, AWQ and DeepSeek-V3/Qwen3-FP8 checkpoints
do: those are the formats' conventions, the head is the matrix most sensitive to error, and a table's rows are read
a few at a time, so quantizing it saves memory but no time."""

from __future__ import annotations

import logging
from collections import defaultdict
from math import gcd, prod

import numpy as np
from tqdm.auto import tqdm

from ir.formats import fp8_blocks, int_groups
from ir.formats.gguf_quantize import quantize
from ir.formats.gguf_quants import QTYPES
from ir.formats.quant_common import CHUNK_ELEMS, by_rows
from ir.graph import Graph
from ir.ops import OPS
from ir.weights import StoredTensor, WeightStore

log = logging.getLogger(__name__)

ISQ_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
             "q2k": "Q2_K", "q3k": "Q3_K", "q4k": "Q4_K", "q5k": "Q5_K", "q6k": "Q6_K", "int4": "INT4", "fp8": "FP8"}
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
INT4_GROUPS = (128, 64, 32)  # widest first: the first that divides a row
FP8_BLOCK = (128, 128)


def isq_kind(name: str) -> str:
    """The type an --isq value names ("q4k" -> "Q4_K", "int4" -> "INT4"), or ValueError saying what is accepted."""
    key = name.strip().lower()
    if key not in ISQ_TYPES:
        raise ValueError(f"unknown --isq type {name!r}; expected one of {', '.join(ISQ_TYPES)}")
    return ISQ_TYPES[key]


def _fits(kind: str, n: int) -> bool:
    return n % QTYPES[kind].block_size == 0


def target_kind(kind: str, role: str, n: int) -> str | None:
    """The stored kind a matrix of `role` ("matrix", "embed" or "head") with rows of n values gets under --isq kind,
    after the fallbacks (llama.cpp's for the GGUF types); None where it stays as stored."""
    if kind == "INT4":
        group = next((g for g in INT4_GROUPS if n % g == 0), None)
        return int_groups.kind_name(4, group) if role == "matrix" and group else None
    if kind == "FP8":
        group = gcd(n, FP8_BLOCK[1])
        return fp8_blocks.kind_name(group) if role == "matrix" and group % 16 == 0 else None
    if role == "head":
        kind = "Q8_0" if kind == "Q8_0" or not _fits(kind, n) else "Q6_K"
    if not _fits(kind, n):
        kind = _FALLBACK.get(kind, kind)
    return kind if _fits(kind, n) else None


def _block(kind: str) -> int:
    """The values of a row one unit of `kind` takes (what a row length must be a multiple of to take it unchanged)."""
    return {"INT4": INT4_GROUPS[0], "FP8": FP8_BLOCK[1]}.get(kind) or QTYPES[kind].block_size


def _widest(kind: str) -> str:
    """The stored kind a matrix gets under --isq `kind` where no fallback is needed."""
    return {"INT4": int_groups.kind_name(4, INT4_GROUPS[0]), "FP8": fp8_blocks.kind_name(FP8_BLOCK[1])}.get(kind, kind)


def quantize_values(values: np.ndarray, want: str) -> np.ndarray:
    """values (..., n) -> the stored bytes of kind `want` (a GGUF type, I4_G*, F8E4M3_G*)."""
    n = values.shape[-1]
    if (spec := int_groups.parse_kind(want)) is not None:
        return by_rows(values.reshape(-1, n), max(1, CHUNK_ELEMS // n), lambda r: int_groups.quantize_rtn(r, *spec))
    if fp8_blocks.parse_kind(want) is not None:  # 128x128 blocks within each matrix of a stack: slabs of whole blocks
        step = max(1, CHUNK_ELEMS // (n * FP8_BLOCK[0])) * FP8_BLOCK[0]
        one = lambda r: fp8_blocks.quantize_blockwise(r, FP8_BLOCK)[0]  # noqa: E731
        return np.concatenate([by_rows(m, step, one) for m in values.reshape(-1, *values.shape[-2:])], axis=0)
    return quantize(values, want)


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
    """Replace `store`'s matrices with --isq `isq`'s blocks, in place (see the module docstring for which)."""
    kind = isq_kind(isq)
    plan = {}
    fallbacks: dict[tuple[str, int, str | None], list[str]] = defaultdict(list)
    requantized: list[str] = []
    for name, role in roles(graph).items():
        t = store[name]
        n = t.shape[-1]
        want = target_kind(kind, role, n)
        if role == "head" and kind in ("INT4", "FP8"):
            log.info("isq %s: the LM head (%s) stays as stored, as GPTQ/AWQ/FP8 checkpoints keep it", kind, name)
        elif role == "head":
            log.info("isq %s: the LM head (%s) as %s, llama-quantize's choice for output.weight", kind, name, want)
        elif role == "embed" and kind in ("INT4", "FP8"):
            continue  # kept as stored, as those checkpoints keep it (the module docstring says why)
        elif want != _widest(kind):
            fallbacks[(kind, n, want)].append(name)
        if want is None or t.kind == want:
            continue
        if t.quantized:
            requantized.append(f"{name} ({t.kind})")
        plan[name] = want
    for (k, n, to), names in fallbacks.items():
        gguf = k in QTYPES
        log.warning("isq %s: %d matri%s with rows of %d values (not a whole number of %d-value blocks) %s%s: %s", k,
                    len(names), "x" if len(names) == 1 else "ces", n, _block(k),
                    f"fall back to {to}" if to else "stay as stored" + (" (llama.cpp: F16)" if gguf else ""),
                    ", as llama.cpp's llama-quantize does" if gguf else "",
                    ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))
    if requantized:
        log.warning("isq %s: %d already quantized tensor(s) dequantized and quantized again (error adds up): %s", kind,
                    len(requantized), ", ".join(requantized[:6]) + (", ..." if len(requantized) > 6 else ""))
    total = sum(prod(store[p].shape) for p in plan)
    with tqdm(total=total, desc=f"isq {kind}", unit="weight", unit_scale=True, disable=not progress,
              leave=False) as bar:
        for name, want in plan.items():
            t = store[name]
            try:
                blocks = quantize_values(t.values().reshape(t.shape), want)
            except ValueError as e:
                raise ValueError(f"--isq {isq}: cannot quantize {name} ({t.source or 'no file name'}): {e}") from None
            store[name] = StoredTensor(blocks, want, t.shape, t.source)
            bar.update(prod(t.shape))
    log.info("isq %s: %d tensor(s) quantized (%s)", kind, len(plan),
             ", ".join(f"{k} {sum(1 for v in plan.values() if v == k)}" for k in sorted(set(plan.values()))))

