"""A mixture-of-experts router in one launch: each token's scores, expert choice and weights (the IR's
`moe_route`): DSL kernel, host launcher, reference.

The torch spelling of a router is a dozen small ops a layer (softmax or sigmoid, the correction bias, DeepSeek's
group scores and group mask, top-k, gather, normalization), ~37 us of launches and glue a layer at batch 1 on an
H200, more than the layer's experts take. Here one program takes one token's E logits in one tile:
- scores by softmax (over all experts) or sigmoid, in fp32; the choice is score + bias (DeepSeek-V3's correction
  bias moves the choice, never the weights);
- with groups (n_group > 1, experts e // (E / n_group)), each group's score is its best choice or its best two's sum,
  and only the topk_group best groups' experts may be chosen;
- top_k rounds of "the largest choice, the lowest expert id among equals" (numpy's stable argsort, which the IR's
  semantics use), each taking that expert out;
- the chosen scores, normalized to sum 1 if asked, times routed_scaling.
Masked lanes and removed experts hold NEG (finite: Metal and the SIMT targets compile with fast math).
"""

from __future__ import annotations

import numpy as np

from kernels_src.dsl import compile, elem_stride, empty, tl, use_pdl

NEG = -3.0e38  # below any score + bias
MAX_EXPERTS = 1024  # one tile of logits a program
MAX_TOP_K = 32


def _take_max(v, idx, big):
    """(largest value of v, its lowest index): what one round of numpy's stable descending argsort gives."""
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(v == m, idx, big), axis=0)


def moe_route_kernel(logits, bias, w_out, ids_out, n_experts, per_group, logits_stride, out_stride, routed_scaling,
                     TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                     N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2_SUM: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    emask = e < n_experts
    b = tl.load(bias + e, mask=emask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0  # a weight: before the wait
    if PDL:  # the logits come from the router's linear
        tl.wait_prior_grid()
        tl.launch_dependents()
    x = tl.load(logits + t * logits_stride + e, mask=emask, other=0.0).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        xm = tl.where(emask, x, NEG)
        p = tl.where(emask, tl.exp(xm - tl.max(xm, axis=0)), 0.0)
        s = p / tl.sum(p, axis=0)
    choice = tl.where(emask, s + b, NEG)
    if N_GROUP > 1:
        grp = e // per_group
        g = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], NEG, tl.float32)
        for gi in tl.static_range(N_GROUP):
            mine = tl.where(emask & (grp == gi), choice, NEG)
            best, at = _take_max(mine, e, BLOCK_E)
            if TOP2_SUM:
                best = best + tl.max(tl.where(e == at, NEG, mine), axis=0)
            gscore = tl.where(g == gi, best, gscore)
        keep = g < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            _, at = _take_max(gscore, g, BLOCK_G)
            keep = keep | (g == at)
            gscore = tl.where(g == at, NEG, gscore)
        allowed = e < 0
        for gi in tl.static_range(N_GROUP):
            kept = tl.sum(tl.where(keep & (g == gi), 1, 0), axis=0) > 0
            allowed = allowed | ((grp == gi) & kept)
        choice = tl.where(allowed, choice, NEG)
    k = tl.arange(0, BLOCK_K)
    ws = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for r in tl.static_range(TOP_K):
        _, at = _take_max(choice, e, BLOCK_E)
        ws = tl.where(k == r, tl.sum(tl.where(e == at, s, 0.0), axis=0), ws)
        ids = tl.where(k == r, at, ids)
        choice = tl.where(e == at, NEG, choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    kmask = k < TOP_K
    tl.store(w_out + t * out_stride + k, ws * routed_scaling, mask=kmask)
    tl.store(ids_out + t * out_stride + k, ids, mask=kmask)


def supports(n_experts: int, top_k: int, n_group: int = 1) -> bool:
    """Whether one program's tile takes this router (else the caller keeps its array ops)."""
    return (n_experts <= MAX_EXPERTS and 0 < top_k <= min(MAX_TOP_K, n_experts) and n_group >= 1
            and n_experts % n_group == 0)


def moe_route(logits, bias=None, *, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = False,
              routed_scaling: float = 1.0, n_group: int = 1, topk_group: int = 1, group_score: str = "max",
              target: str = "numpy", pdl: bool | None = None):
    """(weights [T, top_k] fp32, expert ids [T, top_k] int32) for router logits [T, E] (rows may be strided), as the
    IR's moe_route defines them; bias [E] (fp32) or None."""
    t, n = logits.shape
    if not supports(n, top_k, n_group):
        raise ValueError(f"a router of {n} experts, top {top_k}, {n_group} groups does not fit one program's tile "
                         f"(at most {MAX_EXPERTS} experts and top {MAX_TOP_K}, groups dividing the experts)")
    if scoring not in ("softmax", "sigmoid") or group_score not in ("max", "top2_sum"):
        raise ValueError(f"unknown scoring {scoring!r} or group score {group_score!r}")
    if elem_stride(logits, 1) != 1:
        raise ValueError("router logits must be contiguous along the experts")
    w, ids = empty(logits, (t, top_k), "float32"), empty(logits, (t, top_k), "int32")
    if t == 0:
        return w, ids
    pdl = use_pdl(target, pdl)
    kern = compile(moe_route_kernel, target, launch_pdl=pdl, TOP_K=top_k, SIGMOID=scoring == "sigmoid",
                   HAS_BIAS=bias is not None, NORM=bool(norm_topk_prob), N_GROUP=n_group,
                   TOPK_GROUP=min(topk_group, n_group), TOP2_SUM=group_score == "top2_sum",
                   BLOCK_E=max(16, tl.next_power_of_2(n)), BLOCK_K=max(2, tl.next_power_of_2(top_k)),
                   BLOCK_G=max(2, tl.next_power_of_2(n_group)), PDL=pdl)
    kern[t](logits, logits if bias is None else bias, w, ids, n, n // n_group, elem_stride(logits, 0), top_k,
            float(routed_scaling))
    return w, ids


def moe_route_ref(logits: np.ndarray, bias: np.ndarray | None = None, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The IR interpreter's own definition."""
    from ir.interpreter import moe_route

    return moe_route(np.asarray(logits, np.float32), None if bias is None else np.asarray(bias, np.float32), **kw)
