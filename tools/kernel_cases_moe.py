"""The GPU cases of the MoE kernels (tools/kernel_cases.py's BUILDERS): DeepSeek-V3's router, the fused MoE's paths
over dense and GGUF expert stacks (grouped, GEMV a slot, grouped on int8 tensor cores), and moe_align's one launch."""

from __future__ import annotations

import functools

import numpy as np

from kernels_src import moe, moe_gguf, moe_mmq, moe_route
from tools.kernel_case_base import SPREAD, Case, Dev, combine, compare, gguf_weights, host, written

ROUTER = dict(scoring="sigmoid", n_group=8, topk_group=4, group_score="top2_sum", norm_topk_prob=True,
              routed_scaling=2.5)  # DeepSeek-V3's (the registry's bench configuration)


def near_tie(logits: np.ndarray, bias: np.ndarray, k: int, eps: float = 1e-5) -> np.ndarray:
    """Tokens whose choice under ROUTER is decided by less than eps (float64): the 4th and 5th groups' scores, or
    the k-th and next allowed experts'; the GPU's exp may then choose the other way."""
    choice = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    grouped = np.sort(choice.reshape(len(choice), ROUTER["n_group"], -1), axis=-1)
    gs = -np.sort(-(grouped[..., -1] + grouped[..., -2]), axis=-1)
    keep = np.argsort(-(grouped[..., -1] + grouped[..., -2]), axis=-1, kind="stable")[:, :ROUTER["topk_group"]]
    allowed = np.zeros(gs.shape, bool)
    np.put_along_axis(allowed, keep, True, axis=-1)
    c = -np.sort(-np.where(np.repeat(allowed, choice.shape[1] // gs.shape[1], axis=-1), choice, -np.inf), axis=-1)
    t = ROUTER["topk_group"]
    return (gs[:, t - 1] - gs[:, t] < eps) | (c[:, k - 1] - c[:, k] < eps)


def moe_route_case(d: Dev, p: dict) -> Case:
    """DeepSeek-V3's router on random logits: the experts exactly as the IR chooses them on a CPU copy, but for tokens
    whose choice rests on a near tie (near_tie); the weights by fp32 rounding."""
    t, e, k = p["tokens"], p["experts"], p["top_k"]
    logits = d.randn((t, e), d.dtype(p["dtype"]))
    bias = d.randn((e,), d.torch.float32, 0.1)
    out = {}

    def launch(target):
        out["w"], out["ids"] = moe_route.moe_route(logits, bias, top_k=k, target=target, **ROUTER)

    def check():
        w_ref, ids_ref = moe_route.moe_route_ref(host(logits), host(bias), top_k=k, **ROUTER)
        ids = host(out["ids"])
        differ = (ids != ids_ref).any(1) & ~near_tie(host(logits), host(bias), k)
        if differ.any():
            return np.inf, f"experts differ from the reference in {int(differ.sum())} of {t} tokens"
        same = ~(ids != ids_ref).any(1)
        return compare("weights", host(out["w"])[same], w_ref[same], "float32")

    return Case("moe_route", p, launch, check)


def moe_case(d: Dev, p: dict, name: str) -> Case:
    """Routed tokens through a stack of experts: distinct experts per token (a router's top_k), weights that sum to 1;
    the reference on a sample of tokens in float64 (over the experts they use). With `qtype` in p (the _gguf kernels)
    gate is GGUF blocks of it, up of `up_qtype` (default: qtype), down of `down_qtype`, random valid blocks (`padded`:
    rows in wider ones, 16-byte aligned for the GEMV and MMQ). moe_gemm* runs the grouped path, moe_gemv* the GEMV,
    moe_mmq the grouped passes on int8 tensor cores (its reference quantizes x and h as they do), whatever the rules
    would pick."""
    t, h, inner, e, k, dt = p["tokens"], p["hidden"], p["inner"], p["experts"], p["top_k"], d.dtype(p["dtype"])
    torch, gemv, mmq = d.torch, name.startswith("moe_gemv"), name == "moe_mmq"
    ref = functools.partial(moe_mmq.moe_mmq_ref, h_dtype=p["dtype"]) if mmq else moe.moe_experts_ref
    x = d.randn((t, h), dt)
    ids = torch.stack([d.perm(e)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.softmax(torch.randn((t, k), device=d.dev, generator=d.gen), -1)
    shapes = ((inner, h), (inner, h), (h, inner))
    if "qtype" in p:
        qtypes = (p["qtype"], p.get("up_qtype", p["qtype"]), p["down_qtype"])
        stacks = [moe_gguf.GGUFStack(gguf_weights(d, q, e * n, kk, 1 / (SPREAD[q] * kk ** 0.5), p.get("padded", False),
                                                  16 if gemv or mmq else 1), q, (e, n, kk))
                  for q, (n, kk) in zip(qtypes, shapes, strict=True)]
    else:
        stacks = [d.randn((e, n, kk), dt, kk ** -0.5) for n, kk in shapes]
    out = d.nan((t, h), dt)

    def experts(w, used):
        if not moe_gguf.is_blocks(w):
            return host(w[used])
        n = w.shape[1]
        rows = np.concatenate([np.arange(ex * n, (ex + 1) * n) for ex in used])
        return moe_gguf.GGUFStack(host(w.data[rows]), w.qtype, (len(used), *w.shape[1:]))

    def check():
        i = d.sample(t, 32)
        used = sorted(set(host(ids[i]).ravel().tolist()))
        remap = {ex: j for j, ex in enumerate(used)}  # the reference reads only the experts these tokens use
        ids_i = np.vectorize(remap.get)(host(ids[i]))
        want = ref(host(x[i]), host(weights[i]), ids_i, *(experts(w, used) for w in stacks))
        return combine(written("out", out), compare("out", host(out[i]), want, p["dtype"]))

    return Case(name, p, lambda target: moe.moe_experts(x, weights, ids, *stacks, out=out, target=target, gemv=gemv,
                                                        mmq=mmq),
                check, lambda target: out.fill_(float("nan")))


def moe_align_case(d: Dev, p: dict) -> Case:
    """moe_align's one-launch kernel: a router's top_k distinct experts a token, drawn from `used` of the experts
    (default: all; fewer leave experts empty), grouped on the device; rows and block_expert exactly as
    kernels_src/moe.py's `_align` gives them in numpy."""
    t, e, k, bm = p["tokens"], p["experts"], p["top_k"], p["block_m"]
    used = p.get("used", e)
    ids = np.stack([d.rng.choice(used, k, replace=False) for _ in range(t)]).astype(np.int32)
    dev_ids = d.torch.from_numpy(ids).to(d.dev)
    out = {}

    def launch(target):
        out["rows"], out["be"] = moe.moe_align(dev_ids, e, bm, target)

    def check():
        rows, be = moe._align(np, ids.reshape(-1).astype(np.int64), e, bm)
        for what, got, want in (("rows", host(out["rows"]), rows), ("block_expert", host(out["be"]), be)):
            if got.shape != want.shape or (got != want).any():
                return np.inf, f"{what}: {int((got != want).sum()) if got.shape == want.shape else 'shape'} differ"
        return 0.0, None

    return Case("moe_align", p, launch, check)
