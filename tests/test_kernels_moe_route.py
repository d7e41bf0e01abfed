"""The router kernel (kernels_src/moe_route.py) against the IR's moe_route semantics (ir.interpreter, numpy): the
DSL interpreter, Triton's interpreter and the SIMT CPU oracle; softmax and sigmoid scores, DeepSeek's grouped choice
with a correction bias (max and top-two-sum group scores), normalization and scaling, ties broken as numpy's stable
argsort breaks them, fp16 logits, and an sm_90 build."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from kernels_src import moe_route as mr

ROUTERS = {  # name -> (experts, the router's arguments)
    "mixtral": (8, dict(top_k=2)),
    "qwen3_moe": (128, dict(top_k=8, norm_topk_prob=True)),
    "deepseek_v3": (256, dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, group_score="top2_sum",
                              norm_topk_prob=True, routed_scaling=2.5)),
    "deepseek_v2": (160, dict(top_k=6, n_group=8, topk_group=3, routed_scaling=16.0)),  # groups of 20
}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def route(target, logits, bias, **kw):
    w, ids = mr.moe_route(dev(logits, target), None if bias is None else dev(bias, target), target=target, **kw)
    return host(w), host(ids)


def check(got, want):
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_matches_the_ir(target, name, rng):
    n, kw = ROUTERS[name]
    logits = rng.standard_normal((7, n)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32) if kw.get("scoring") == "sigmoid" else None
    check(route(target, logits, bias, **kw), mr.moe_route_ref(logits, bias, **kw))


@pytest.mark.parametrize("target", TARGETS)
def test_ties_go_to_the_lowest_expert(target, rng):
    """Logits on a coarse grid repeat within a token and a group: the lower expert id wins, as in the IR."""
    n, kw = ROUTERS["deepseek_v3"]
    logits = np.round(rng.standard_normal((6, n)) * 2) / 2
    logits = logits.astype(np.float32)
    check(route(target, logits, np.zeros(n, np.float32), **kw), mr.moe_route_ref(logits, np.zeros(n), **kw))
    logits[:, :] = 0.5  # every expert equal: experts 0..7 of the lowest groups
    w, ids = route(target, logits, None, top_k=4)
    assert (ids == np.arange(4)).all() and np.allclose(w, 1 / n)


@pytest.mark.parametrize("target", TARGETS)
def test_fp16_logits_and_strided_rows(target, rng):
    """The router's linear output as it comes: fp16, rows of a wider buffer."""
    n, kw = ROUTERS["qwen3_moe"]
    wide = rng.standard_normal((5, n + 16)).astype(np.float16)
    logits = wide[:, :n]
    got = route(target, logits, None, **kw)
    check(got, mr.moe_route_ref(logits.astype(np.float32), None, **kw))


def test_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) through the CPU fiber oracle: the grouped case."""
    n, kw = 64, dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum", norm_topk_prob=True)
    logits, bias = rng.standard_normal((3, n)).astype(np.float32), (0.1 * rng.standard_normal(n)).astype(np.float32)
    check(route("simt-cpu", logits, bias, **kw), mr.moe_route_ref(logits, bias, **kw))


def test_what_does_not_fit_is_refused():
    assert not mr.supports(2048, 8) and not mr.supports(160, 6, n_group=7) and mr.supports(160, 6, n_group=8)
    with pytest.raises(ValueError, match="does not fit"):
        mr.moe_route(np.zeros((1, 2048), np.float32), top_k=8)


@pytest.mark.skipif(not HAS_TRITON or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
def test_aot_sm90(tmp_path, monkeypatch):
    """DeepSeek-V3's router builds for an H200 without a GPU: the grid dependency wait, nothing spilled."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry = REGISTRY["moe_route"]
    c = aot_compile(entry.kernel("triton").trace(signature=entry.signature), arch=90, num_warps=4)
    assert "griddepcontrol.wait" in c.asm["ptx"]
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0


@pytest.mark.skipif(not HAS_TRITON, reason="torch is not installed")
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_torch_fallback_matches_the_ir(name, rng):
    """The CUDA runner's torch spelling (backends.cuda.torch_ops.moe_route), which routers too large for the tile
    take, chooses as the IR does."""
    import torch

    from backends.cuda import torch_ops

    n, kw = ROUTERS[name]
    logits = rng.standard_normal((7, n)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32) if kw.get("scoring") == "sigmoid" else None
    w, ids = torch_ops.moe_route(torch.from_numpy(logits), None if bias is None else torch.from_numpy(bias), **kw)
    check((w.numpy(), ids.numpy()), mr.moe_route_ref(logits, bias, **kw))
