"""The fused MoE (kernels_src/moe.py) against its float64 reference, token by token: the DSL interpreter, Triton's
interpreter and the SIMT CPU oracle, fp32 and fp16, routings that leave experts empty and crowd others past a
block, one token (decode) and many; outputs poisoned first. moe_align on its own: every slot once, each block one
expert, the bound on blocks whatever the routing, and numpy and torch giving the same layout. slot_bounds: every slot
count where a rule picks other kernels or tiles, and no other."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from kernels_src import moe

TOL = {np.float32: 1e-5, np.float16: 3e-3}  # of the largest output


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def routing(rng, tokens: int, experts: int, k: int, crowd: bool = False):
    """Distinct experts per token with weights summing to 1; `crowd`: most tokens pick the first experts, so some
    take several blocks and others none."""
    p = np.r_[np.full(2, 10.0), np.ones(experts - 2)] if crowd else np.ones(experts)
    ids = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, k)).astype(np.float32)
    return ids, w / w.sum(1, keepdims=True)


def problem(rng, tokens, hidden, inner, experts, k, dtype, crowd=False):
    x = rng.standard_normal((tokens, hidden)).astype(dtype)
    gate, up = ((rng.standard_normal((experts, inner, hidden)) / hidden ** 0.5).astype(dtype) for _ in range(2))
    down = (rng.standard_normal((experts, hidden, inner)) / inner ** 0.5).astype(dtype)
    return (x, *routing(rng, tokens, experts, k, crowd)[::-1], gate, up, down)


def run(target, args, act, **kw):
    """The grouped kernels (at few slots too: the GEMV path has tests/test_kernels_moe_gemv.py)."""
    x, w, ids, gate, up, down = args
    out = dev(np.full(x.shape, np.nan, x.dtype), target)
    got = moe.moe_experts(*(dev(a, target) for a in (x, w, ids, gate, up, down)), act, out=out, target=target,
                          **{"gemv": False} | kw)
    assert got is out
    return host(out)


def close(got, want, tol):
    assert np.isfinite(got).all(), "outputs left unwritten"
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("tokens,crowd", [(1, False), (7, False), (40, True)])
def test_moe_experts(target, dtype, tokens, crowd, rng):
    """K and N off the tiles (72 and 40 against 64-wide blocks); 40 crowded tokens give an expert three blocks."""
    args = problem(rng, tokens, 72, 40, 6, 2, dtype, crowd)
    act = "silu" if dtype == np.float32 else "gelu_tanh"
    close(run(target, args, act), moe.moe_experts_ref(*args, act), TOL[dtype])


@pytest.mark.parametrize("target", TARGETS)
def test_moe_experts_prefill_tiles(target, rng):
    """The prefill's tall tiles (64 slots a block), which default_tiles picks at 64 slots an expert."""
    args = problem(rng, 96, 72, 40, 3, 2, np.float32)
    assert moe.default_tiles(96 * 2, 3) == (64, 32) and moe.default_tiles(4096, 16) == (64, 64)
    close(run(target, args, "silu"), moe.moe_experts_ref(*args, "silu"), TOL[np.float32])


def test_moe_experts_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) through the CPU fiber oracle, at small tiles."""
    args = problem(rng, 5, 40, 24, 4, 2, np.float32)
    close(run("simt-cpu", args, "silu", block_n=16, block_k=16), moe.moe_experts_ref(*args, "silu"), 1e-5)


@pytest.mark.parametrize("crowd", [False, True])
def test_align_groups_every_slot_once(crowd, rng):
    experts, block = 8, 16
    ids, _ = routing(rng, 50, experts, 3, crowd)
    rows, block_expert = moe.moe_align(ids, experts, block)
    s = ids.size
    assert len(block_expert) == moe.max_blocks(s, experts, block) and len(rows) == len(block_expert) * block
    assert sorted(rows[rows < s].tolist()) == list(range(s))  # each slot once, the rest padding
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert):
        real = rows[b * block:(b + 1) * block]
        real = real[real < s]
        assert (flat[real] == e).all()  # a block holds one expert's slots
    if HAS_TRITON:
        import torch

        t_rows, t_be = moe.moe_align(torch.from_numpy(ids), experts, block)
        np.testing.assert_array_equal(t_rows.numpy(), rows)
        np.testing.assert_array_equal(t_be.numpy(), block_expert)


def test_bad_stacks_are_refused(rng):
    x, w, ids, gate, up, down = problem(rng, 2, 16, 8, 4, 2, np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        moe.moe_experts(x, w, ids, gate, up, down[:, :8])


@pytest.mark.skipif(not HAS_TRITON or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("gated", [True, False])
def test_aot_sm90(gated, tmp_path, monkeypatch):
    """Both launches at the registry's configuration build for an H200 without a GPU: tensor-core MMAs, the grid
    dependency wait, nothing spilled."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry = REGISTRY["moe_gemm"]
    kir = entry.kernel("triton", GATED=gated).trace(signature=entry.signature)
    c = aot_compile(kir, arch=90, num_warps=4)
    ptx = c.asm["ptx"]
    assert ("wgmma.mma_async" in ptx or "mma.sync" in ptx) and "griddepcontrol.wait" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0


@pytest.mark.parametrize("experts", [3, 8, 16, 64, 128, 256])
@pytest.mark.parametrize("mmq", [False, True], ids=["mmq-off", "mmq-on"])
def test_slot_bounds_are_where_the_rules_change(monkeypatch, experts, mmq):
    """moe.slot_bounds is exactly the set of slot counts S where one of the rules that pick a step's kernels or
    constexprs from S gives another answer than at S - 1 (read from the rules themselves, over dense and Q4_K
    stacks, on the Triton target): default_tiles, the GEMV's, moe_dequant's, moe_mmq's two, the int8 GEMV's,
    moe_align's kernel's."""
    from kernels_src import moe_align, moe_dequant, moe_gemv, moe_gguf, moe_mmq

    monkeypatch.setattr(moe_mmq, "MMQ", mmq)
    dense = [np.zeros((experts, 1, 256), np.float16)] * 3
    q4k = [moe_gguf.GGUFStack(np.zeros((experts, 144), np.uint8), "Q4_K", (experts, 1, 256))] * 3
    assert moe_gguf.whole_words(*q4k) and moe_gemv.stack_fits(q4k[0])  # numpy's buffers are 16-byte aligned

    def rules(s: int) -> tuple:
        return (moe.default_tiles(s, experts), moe_gemv.use_gemv(s, experts, dense),
                moe_gemv.use_gemv(s, experts, q4k), moe_dequant.use_dequant(s, experts, q4k),
                moe_mmq.use_mmq(s, experts), moe_mmq.over_gemv(s, *q4k[:2], 256),
                moe_gemv.uses_i8("triton", *q4k[:2], slots=s), moe.ALIGN_KERNEL and moe_align.supports(s, experts))

    most = 2 * moe.TALL_SLOTS_PER_EXPERT * experts
    changes = [s for s in range(2, most) if rules(s) != rules(s - 1)]
    assert changes == [b for b in moe.slot_bounds(experts) if b < most]
