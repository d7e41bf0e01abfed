"""The IR ops the CUDA backend runs as plain torch ops, with no DSL kernel: a lone activation (the fused `gated`
has one), layer norm, an RMS norm whose weight offset the kernel does not take, a router too large for
kernels_src/moe_route's one tile; and the chunked dequantize-then-GEMM that every quantized family falls back to."""

from __future__ import annotations

from collections.abc import Callable

from backends.cuda.runtime import torch

F = torch.nn.functional


def linear_into(x, w, out=None):
    """x @ w.T by cuBLAS (F.linear); into `out` [rows, N] when given: an eager step's kept buffer
    (backends/cuda/step_arena.py), sparing the allocation (~7 us of host time on an H200's host, four a layer at 16
    rows). torch.mm is what F.linear runs for a 2-D x without a bias: the same GEMM, the same numbers."""
    if out is None:
        return F.linear(x, w)
    return torch.mm(x, w.t(), out=out)


def dequantized_matmul(x2, n: int, row_bytes: int, chunk_bytes: int, rows: Callable[[int, int], object]):
    """x2 @ W.T for W [n, K] that `rows(r0, r1)` dequantizes, chunk_bytes of it at a time (row_bytes a row): a
    prefill's cuBLAS GEMM without a dense copy of W in memory."""
    step = max(1, chunk_bytes // row_bytes)
    if step >= n:
        return x2 @ rows(0, n).T
    y = torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        y[:, r0:r1] = x2 @ rows(r0, r1).T
    return y


def act(op: str, x):
    if op == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if op == "gelu_tanh" else "none")


def moe_route(logits, bias=None, *, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = False,
              routed_scaling: float = 1.0, n_group: int = 1, topk_group: int = 1, group_score: str = "max"):
    x = logits.float()
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:  # only the best topk_group groups' experts may be chosen
        grouped = choice.view(choice.shape[0], n_group, -1)
        top = grouped.topk(1 if group_score == "max" else 2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(top).scatter_(1, top.topk(topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(keep.repeat_interleave(grouped.shape[-1], dim=-1) == 0, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    w = scores.gather(-1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling, ids.to(torch.int32)


def layer_norm(x, w, b, eps: float):
    if w.dim() == 1:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    y = F.layer_norm(x, (x.shape[-1],), None, None, eps) * w  # per head [heads, d]: torch's weight must be [d]
    return y if b is None else y + b


def rms_norm(x, w, eps: float, offset: float):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + offset)).to(x.dtype)
