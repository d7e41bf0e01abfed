"""The IR's op table: each op's operands, attributes and shape/dtype inference.

Dimensions are ints or symbols: "T" (tokens in the batch), "B" (sequences), "M" (blocks per
sequence in the block table), "N" (rows that need logits). The numpy semantics of every op live in
`ir.interpreter`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from ir.rope import long_after

Dim = int | str
DTYPES = ("f32", "f16", "bf16", "i32")


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


Infer = Callable[[list[TensorType | None], dict[str, Any]], TensorType | tuple[TensorType, ...]]


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[str, ...]  # names; a trailing "?" marks an optional operand
    infer: Infer
    doc: str
    # Operand positions that read a weight matrix (or a stack of them): parameters there may stay in a quantized
    # format, whatever their rank; every other parameter is read as plain values.
    weights: tuple[int, ...] = ()
    kv_cache: bool = False  # writes this step's k and v (or latent) into the paged cache of attrs["layer"], attends
    fused: bool = False  # made by ir.fusion from plainer ops, never by a model builder


def _same_dim(a: Dim, b: Dim, what: str) -> None:
    if isinstance(a, int) and isinstance(b, int) and a != b:
        raise ValueError(f"{what}: {a} != {b}")
    if isinstance(a, str) and isinstance(b, str) and a != b:
        raise ValueError(f"{what}: {a} != {b}")


def _float(t: TensorType, what: str) -> None:
    if t.dtype == "i32":
        raise ValueError(f"{what} must be a float tensor, got {t}")


def _int(t: TensorType, what: str) -> None:
    if t.dtype != "i32":
        raise ValueError(f"{what} must be i32, got {t}")


def _embedding(ts, a):
    table, ids = ts
    _int(ids, "ids")
    if len(table.shape) != 2:
        raise ValueError("embedding table must be 2-D")
    return TensorType(ids.shape + (table.shape[1],), a.get("dtype", table.dtype))


def _linear(ts, a):
    x, w, b = (ts + [None])[:3]
    _float(x, "x")
    if len(w.shape) != 2:
        raise ValueError("linear weight must be [out, in]")
    _same_dim(x.shape[-1], w.shape[1], "linear in-features")
    if b is not None:
        _same_dim(b.shape[0], w.shape[0], "linear bias")
    return TensorType(x.shape[:-1] + (w.shape[0],), x.dtype)


def _norm(ts, a):
    x, w = ts[0], ts[1]
    _float(x, "x")
    _same_dim(x.shape[-1], w.shape[0], "norm weight")
    if "eps" not in a:
        raise ValueError("norm needs eps")
    return x


def _layer_norm(ts, a):
    x, w, b = (ts + [None])[:3]
    _float(x, "x")
    # w (and b) cover x's last dim, or its last two: a per-head norm ([heads, head_dim], stablelm's q/k norms).
    # Either way the statistics run over the last dim only.
    if not 1 <= len(w.shape) <= min(2, len(x.shape)):
        raise ValueError(f"layer_norm weight {w} must be [d] or [heads, d] for x {x}")
    for i in range(1, len(w.shape) + 1):
        _same_dim(x.shape[-i], w.shape[-i], "norm weight")
    if b is not None and b.shape != w.shape:
        raise ValueError(f"layer_norm bias {b} does not match its weight {w}")
    if "eps" not in a:
        raise ValueError("norm needs eps")
    return x


def _rope(ts, a):
    x, pos, *seq = ts
    _int(pos, "positions")
    if len(x.shape) != 3:
        raise ValueError("rope input must be [T, heads, head_dim]")
    _same_dim(x.shape[0], pos.shape[0], "rope tokens")
    spec = a["spec"]
    if isinstance(x.shape[2], int) and spec.rotary_dim > x.shape[2]:
        raise ValueError(f"rotary_dim {spec.rotary_dim} > head_dim {x.shape[2]}")
    seq = [t for t in seq if t is not None]
    if long_after(spec) is not None and len(seq) != 2:
        raise ValueError("longrope picks its table by each sequence's length: rope needs context_lens and query_start")
    for t in seq:
        _int(t, "context_lens / query_start")
    return x


def _attention(ts, a):
    q, k, v, slots, tables, ctx, qstart = ts
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if len(t.shape) != 3:
            raise ValueError(f"attention {n} must be [T, heads, head_dim]")
    _int(slots, "slot_mapping")
    _int(tables, "block_tables")
    _int(ctx, "context_lens")
    _int(qstart, "query_start")
    hq, hkv = q.shape[1], k.shape[1]
    if isinstance(hq, int) and isinstance(hkv, int) and hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    _same_dim(k.shape[1], v.shape[1], "k/v heads")
    _same_dim(q.shape[2], k.shape[2], "q/k head_dim")
    for key in ("layer", "scale"):
        if key not in a:
            raise ValueError(f"attention needs {key}")
    return TensorType(q.shape[:2] + (v.shape[2],), q.dtype)


def _latent_attention(ts, a):
    q, kv, *meta = ts
    for t, n in ((q, "q"), (kv, "kv")):
        if len(t.shape) != 3:
            raise ValueError(f"latent_attention {n} must be [T, heads, dim]")
    for t, n in zip(meta, ("slot_mapping", "block_tables", "context_lens", "query_start"), strict=True):
        _int(t, n)
    hq, hkv = q.shape[1], kv.shape[1]
    if isinstance(hq, int) and isinstance(hkv, int) and hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of latent heads {hkv}")
    _same_dim(q.shape[2], kv.shape[2], "q/latent dim")
    for key in ("layer", "scale", "value_dim"):
        if key not in a:
            raise ValueError(f"latent_attention needs {key}")
    dv = a["value_dim"]
    if not isinstance(dv, int) or dv < 1 or (isinstance(kv.shape[2], int) and dv > kv.shape[2]):
        raise ValueError(f"value_dim {dv!r} must be 1..{kv.shape[2]} (the latent's leading part)")
    return TensorType(q.shape[:2] + (dv,), q.dtype)


def _head_linear(ts, a):
    x, w = ts
    _float(x, "x")
    if len(x.shape) != 3 or len(w.shape) != 3:
        raise ValueError(f"head_linear takes x [T, heads, in] and w [heads, out, in], not {x} and {w}")
    _same_dim(x.shape[1], w.shape[0], "heads")
    _same_dim(x.shape[2], w.shape[2], "head_linear in-features")
    return TensorType((x.shape[0], x.shape[1], w.shape[1]), x.dtype)


def _rope_attention(ts, a):
    q, k, v, pos, *rest = ts
    _rope([q, pos, *rest[2:]], a)
    _rope([k, pos, *rest[2:]], a)
    return _attention([q, k, v, *rest], a)


def _rope_pair(ts, a):
    q, k, *rest = ts
    return _rope([q, *rest], a), _rope([k, *rest], a)


def _add_rms_norm(ts, a):
    x, y, w = ts
    s = _binary([x, y], a)
    return s, _norm([s, w], a)


def _gated(ts, a):
    if a.get("act") not in GATED_ACTS:
        raise ValueError(f"gated needs act in {GATED_ACTS}, got {a.get('act')!r}")
    return _binary(ts, a)


def _concat(ts, a):
    """x and y joined along the last dim; either may be 1 along another dim (one rope key for every head)."""
    x, y = ts
    if len(x.shape) != len(y.shape):
        raise ValueError(f"rank mismatch {x} vs {y}")
    if x.dtype != y.dtype:
        raise ValueError(f"concat of {x} and {y}")
    shape = []
    for i, (p, q) in enumerate(zip(x.shape[:-1], y.shape[:-1], strict=True)):
        if p != 1 and q != 1:
            _same_dim(p, q, f"dim {i}")
        shape.append(q if p == 1 else p)
    last = x.shape[-1] + y.shape[-1] if isinstance(x.shape[-1], int) and isinstance(y.shape[-1], int) else None
    if last is None:
        raise ValueError("concat needs known last dims")
    return TensorType((*shape, last), x.dtype)


def _slice(ts, a):
    x = ts[0]
    start, size = a["start"], a["size"]
    last = x.shape[-1]
    if start < 0 or size <= 0 or (isinstance(last, int) and start + size > last):
        raise ValueError(f"slice [{start}:{start + size}] of a last dim of {last}")
    return TensorType(x.shape[:-1] + (size,), x.dtype)


def _unary(ts, a):
    _float(ts[0], "x")
    return ts[0]


def _binary(ts, a):
    x, y = ts
    if len(x.shape) != len(y.shape):
        raise ValueError(f"rank mismatch {x} vs {y}")
    for i, (p, q) in enumerate(zip(x.shape, y.shape, strict=True)):
        _same_dim(p, q, f"dim {i}")
    return x


def _broadcast(ts, a):
    """Same shapes, or y 1 along a dim x has (a per-token gate [T, 1] on [T, H])."""
    x, y = ts
    if len(x.shape) != len(y.shape):
        raise ValueError(f"rank mismatch {x} vs {y}")
    for i, (p, q) in enumerate(zip(x.shape, y.shape, strict=True)):
        if q != 1:
            _same_dim(p, q, f"dim {i}")
    return x


def _moe_route(ts, a):
    logits, bias = (ts + [None])[:2]
    _float(logits, "router logits")
    if len(logits.shape) != 2:
        raise ValueError("router logits must be [T, experts]")
    experts, k = logits.shape[1], a.get("top_k")
    if not isinstance(k, int) or k < 1 or (isinstance(experts, int) and k > experts):
        raise ValueError(f"top_k {k!r} must be 1..{experts}")
    if a.get("scoring", "softmax") not in ("softmax", "sigmoid"):
        raise ValueError(f"router scoring {a.get('scoring')!r}: softmax or sigmoid")
    if bias is not None:
        _same_dim(bias.shape[0], experts, "router correction bias")
    groups, keep = a.get("n_group", 1), a.get("topk_group", 1)
    if groups > 1 and (not isinstance(experts, int) or experts % groups or not 1 <= keep <= groups
                       or a.get("group_score", "max") not in ("max", "top2_sum")):
        raise ValueError(f"{experts} experts in {groups} groups, {keep} kept, scored by {a.get('group_score')!r}")
    return TensorType((logits.shape[0], k), "f32"), TensorType((logits.shape[0], k), "i32")


def _moe_experts(ts, a):
    x, weights, ids, gate, up, down = ts
    _float(x, "x")
    _int(ids, "expert ids")
    if any(len(w.shape) != 3 for w in (gate, up, down)):
        raise ValueError("expert weights must be stacks [experts, out, in]")
    _same_dim(weights.shape[1], ids.shape[1], "top_k")
    _same_dim(gate.shape[2], x.shape[-1], "expert in-features")
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate} and up {up} stacks differ")
    _same_dim(down.shape[2], gate.shape[1], "expert inner size")
    _same_dim(down.shape[0], gate.shape[0], "experts")
    if a.get("act") not in GATED_ACTS:
        raise ValueError(f"moe_experts needs act in {GATED_ACTS}, got {a.get('act')!r}")
    return TensorType(x.shape[:-1] + (down.shape[1],), x.dtype)


def _reshape(ts, a):
    x = ts[0]
    shape = tuple(a["shape"])
    known_in = [d for d in x.shape if isinstance(d, int)]
    known_out = [d for d in shape if isinstance(d, int)]
    sym_in = sorted(d for d in x.shape if isinstance(d, str))
    sym_out = sorted(d for d in shape if isinstance(d, str))
    if sym_in != sym_out or prod(known_in) != prod(known_out):
        raise ValueError(f"cannot reshape {x} to {shape}")
    return TensorType(shape, x.dtype)


def _all_gather(ts, a):
    x, world = ts[0], a.get("world")
    if not isinstance(world, int) or world < 1 or not isinstance(x.shape[-1], int):
        raise ValueError(f"all_gather needs a world size >= 1 and a known last dim, got {world!r} and {x}")
    return TensorType(x.shape[:-1] + (x.shape[-1] * world,), x.dtype)


def _gather_rows(ts, a):
    x, idx = ts
    _int(idx, "indices")
    return TensorType(idx.shape + x.shape[1:], x.dtype)


GATED_ACTS = ("silu", "gelu", "gelu_tanh")


def _op(name: str, operands: Sequence[str], infer: Infer, doc: str, weights: tuple[int, ...] = (),
        **flags: bool) -> OpDef:
    return OpDef(name, tuple(operands), infer, doc, weights, **flags)


OPS: dict[str, OpDef] = {o.name: o for o in [
    _op("embedding", ["table", "ids"], _embedding, "rows of table at ids; with vocab_start (a vocab-parallel shard), "
        "row id - vocab_start, zeros for ids outside the table", weights=(0,)),
    _op("linear", ["x", "w", "b?"], _linear, "x @ w.T (+ b); w is [out, in], dense or quantized", weights=(1,)),
    _op("rms_norm", ["x", "w"], _norm, "x / rms(x) * (w + offset) over the last dim, in fp32"),
    _op("layer_norm", ["x", "w", "b?"], _layer_norm,
        "(x - mean) / std * w + b over the last dim; w, b [d] or per head [heads, d]"),
    _op("rope", ["x", "positions", "context_lens?", "query_start?"], _rope,
        "rotary embedding on the first rotary_dim of each head; longrope's table per token by its sequence's length"),
    _op("attention", ["q", "k", "v", "slot_mapping", "block_tables", "context_lens", "query_start"],
        _attention, "write k, v into the paged cache of `layer`, then causal attention over it", kv_cache=True),
    _op("latent_attention", ["q", "kv", "slot_mapping", "block_tables", "context_lens", "query_start"],
        _latent_attention, "write kv [T, Hkv, D] into the paged cache of `layer` (keys only), then causal attention "
        "over it whose values are each key's first value_dim elements (MLA's latent): out [T, Hq, value_dim]",
        kv_cache=True),
    _op("head_linear", ["x", "w"], _head_linear, "x[t, h] @ w[h].T per head: x [T, H, in], w [H, out, in]"),
    _op("silu", ["x"], _unary, "x * sigmoid(x)"),
    _op("sigmoid", ["x"], _unary, "1 / (1 + exp(-x))"),
    _op("gelu", ["x"], _unary, "exact (erf) gelu"),
    _op("gelu_tanh", ["x"], _unary, "tanh-approximated gelu"),
    _op("softcap", ["x"], _unary, "cap * tanh(x / cap)"),
    _op("scale", ["x"], _unary, "x * factor"),
    _op("add", ["x", "y"], _binary, "x + y"),
    _op("mul", ["x", "y"], _broadcast, "x * y; y may be 1 along a dim of x (a per-token gate)"),
    _op("reshape", ["x"], _reshape, "same elements, new shape (symbols must be kept)"),
    _op("gather_rows", ["x", "indices"], _gather_rows, "x[indices] along the first dim"),
    _op("slice", ["x"], _slice, "x[..., start:start + size] (a fused linear's part; MLA's rope and nope parts)"),
    _op("concat", ["x", "y"], _concat, "x and y along the last dim, a size-1 dim of either broadcast"),
    _op("moe_route", ["logits", "bias?"], _moe_route,
        "(weights f32 [T, k], expert ids i32 [T, k]): each token's top_k experts by softmax (or sigmoid) score, "
        "bias added for the choice only, within the best topk_group of n_group groups; weights renormalized "
        "(norm_topk_prob), times routed_scaling"),
    _op("moe_experts", ["x", "weights", "ids", "w_gate", "w_up", "w_down"], _moe_experts,
        "sum over k of weights[t, k] * down[e](act(gate[e] x) * up[e] x), e = ids[t, k]; stacks [E, out, in]",
        weights=(3, 4, 5)),
    # Collectives (ir.sharding puts them in a rank's graph): on one process both are the identity.
    _op("all_reduce", ["x"], _unary, "the sum of x over every rank"),
    _op("all_gather", ["x"], _all_gather, "every rank's x along the last dim, in rank order (`world` of them)"),
    # Fused ops: ir.fusion rewrites plainer ops into these, and each means exactly what those ops computed.
    _op("gated", ["gate", "up"], _gated, "act(gate) * up", fused=True),
    _op("add_rms_norm", ["x", "y", "w"], _add_rms_norm, "(x + y, rms_norm(x + y, w)): two results", fused=True),
    _op("rope_pair", ["q", "k", "positions", "context_lens?", "query_start?"], _rope_pair,
        "(rope(q), rope(k)) with one spec: two results", fused=True),
    _op("rope_attention", ["q", "k", "v", "positions", "slot_mapping", "block_tables", "context_lens", "query_start"],
        _rope_attention, "attention(rope(q), rope(k), v, ...): k is rotated on its way into the cache",
        kv_cache=True, fused=True),
]}
