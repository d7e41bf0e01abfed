"""The grouped MoE's GGUF passes as chunks of dequantized experts through the dense kernel (kernels_src/moe_dequant.py,
through moe.moe_experts(dequant=True)) against the float64 reference on stacks decoded by gguf-py: Q4_K gate/up with
Q6_K down (Q4_K_M), Q8_0 throughout, a quantized pass beside a dense one; a scratch forced small so that both passes
take several chunks, the last one shorter; a routing that leaves an expert without slots; outputs poisoned first.
The chunks' layout on its own (numpy and torch alike, each real slot in exactly its expert's chunk), the rule, and
the dense kernel at the prefill tiles this path runs it at, built for sm_90 in fp16."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS
from test_kernels_moe import routing
from test_kernels_moe_gguf import TOL, check, stack

from kernels_src import moe, moe_dequant

EMPTY = 3  # the expert no token routes to


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def problem(rng, tokens, hidden, inner, experts, k, qtypes, dtype=np.float32, crowd=True):
    """(x, weights, ids, gate, up, down): a routing over every expert but EMPTY, each of the others with slots (so a
    chunk's experts dequantized in the wrong place show)."""
    x = rng.standard_normal((tokens, hidden)).astype(dtype)
    ids, w = routing(rng, tokens, experts - 1, k, crowd)
    ids = np.where(ids >= EMPTY, ids + 1, ids).astype(np.int32)
    assert sorted(set(ids.reshape(-1).tolist())) == [e for e in range(experts) if e != EMPTY]
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    return (x, w, ids, *(stack(rng, q, experts, *s) for q, s in zip(qtypes, shapes, strict=True)))


def small_scratch(monkeypatch, experts: int, hidden: int, inner: int, item: int) -> tuple[int, int]:
    """A scratch of two experts' gate and up: (gate/up chunk, down chunk) in experts, each pass several chunks."""
    monkeypatch.setattr(moe_dequant, "SCRATCH_BYTES", 2 * 2 * inner * hidden * item)
    chunks = [moe_dequant.chunk_experts(experts, n * inner * hidden * item, moe_dequant.SCRATCH_BYTES)
              for n in (2, 1)]
    assert all(c < experts for c in chunks) and experts % chunks[0]  # several chunks, the last one shorter
    return chunks[0], chunks[1]


@pytest.mark.parametrize("qtypes", [("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q6_K", None)])
def test_moe_dequant_kquants(qtypes, rng, monkeypatch):
    """Q4_K_M's stacks (3 chunks of gate/up, 2 of down) and Q6_K gate/up beside a dense down, on the DSL
    interpreter: 24 tokens top 2 over 5 experts, one of them empty, others past a block of 16 slots."""
    assert small_scratch(monkeypatch, 5, 256, 256, 4) == (2, 3)
    args = problem(rng, 24, 256, 256, 5, 2, qtypes)
    check("numpy", args, dequant=True)


@pytest.mark.parametrize("target", TARGETS)
def test_moe_dequant_q8_0_fp16(target, rng, monkeypatch):
    """Q8_0 throughout, fp16 activations (the scratch in fp16), gelu_tanh; N off the dense tiles on the DSL
    interpreter, one 64-wide tile on Triton's."""
    small_scratch(monkeypatch, 5, 64, 32, 2)
    args = problem(rng, 12, 64, 32, 5, 2, ("Q8_0",) * 3, np.float16, crowd=False)
    check(target, args, "gelu_tanh", TOL[np.float16], dequant=True, **({} if target == "numpy" else dict(block_n=64)))


def test_chunk_layout(rng):
    """Row i of the layout keeps exactly the real slots of chunk i's experts, in moe_align's places, and block_expert
    becomes each expert's index in its chunk; torch's layout equals numpy's."""
    experts, block, chunk = 7, 4, 3
    ids, _ = routing(rng, 20, experts, 2, crowd=True)
    rows, be = moe.moe_align(ids, experts, block)
    s, n_chunks = ids.size, 3
    got, local = moe_dequant.chunk_layout(rows, be, s, block, chunk, n_chunks)
    assert got.shape == (n_chunks, rows.size) and got.dtype == np.int32 and local.dtype == np.int32
    flat = ids.reshape(-1)
    for i in range(n_chunks):
        real = got[i] < s
        np.testing.assert_array_equal(got[i][real], rows[real])  # moe_align's slots, in place
        assert (flat[got[i][real]] // chunk == i).all()
        mine = (flat // chunk == i).nonzero()[0]
        assert sorted(got[i][real].tolist()) == mine.tolist()  # each of the chunk's slots once
    np.testing.assert_array_equal(local, be % chunk)
    if HAS_TRITON:
        import torch

        t_got, t_local = moe_dequant.chunk_layout(torch.from_numpy(rows), torch.from_numpy(be), s, block, chunk,
                                                  n_chunks)
        assert t_got.dtype == torch.int32 and t_local.dtype == torch.int32
        np.testing.assert_array_equal(t_got.numpy(), got)
        np.testing.assert_array_equal(t_local.numpy(), local)


def test_chunk_experts():
    assert moe_dequant.chunk_experts(128, 2 * 768 * 2048 * 2, 256 * 2**20) == 32  # Qwen3-30B-A3B's gate/up, fp16
    assert moe_dequant.chunk_experts(128, 2048 * 768 * 2, 256 * 2**20) == 64  # its down
    assert moe_dequant.chunk_experts(5, 10, 1) == 1  # one expert at least
    assert moe_dequant.chunk_experts(8, 1, 100) == 8


def test_rule(rng, monkeypatch):
    """Off when switched off (LLM_ENGINE_MOE_DEQUANT=0); on, GGUF stacks at DEQUANT_SLOTS_PER_EXPERT slots an expert
    or more."""
    q4k = stack(rng, "Q4_K", 2, 256, 256)
    dense = np.zeros((2, 256, 256), np.float32)
    monkeypatch.setattr(moe_dequant, "DEQUANT", False)
    assert not moe_dequant.use_dequant(10**6, 2, (q4k, q4k, q4k))
    monkeypatch.setattr(moe_dequant, "DEQUANT", True)
    least = moe_dequant.DEQUANT_SLOTS_PER_EXPERT * 128
    assert moe_dequant.use_dequant(least, 128, (q4k, q4k, dense))
    assert not moe_dequant.use_dequant(least - 1, 128, (q4k, q4k, q4k))
    assert not moe_dequant.use_dequant(least, 128, (dense, dense, dense))


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("slots", [2048, 16384])
def test_aot_sm90_prefill_tiles(gated, slots, tmp_path, monkeypatch):
    """The dense kernel at the tiles and warps dequantized chunks take (moe.default_tiles at 256 and 2,048 tokens of
    top 8 over 128 experts, moe_dequant.warps) over fp16 (the GGUF default) builds for an H200: tensor-core MMAs, the
    grid dependency wait, no spills. (dequantize_rows' builds: tests/test_kernels_dequantize.py.)"""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import REGISTRY

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    block_m, block_n = moe.default_tiles(slots, 128)
    entry = REGISTRY["moe_gemm"]
    fp16 = {p: "*fp16" for p in ("x", "w_a", "w_b", "y")}
    kir = entry.kernel("triton", GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n).trace(signature=entry.signature |
                                                                                     fp16)
    c = aot_compile(kir, arch=90, num_warps=moe_dequant.warps(gated, block_m, block_n))
    ptx = c.asm["ptx"]
    assert ("wgmma.mma_async" in ptx or "mma.sync" in ptx) and "griddepcontrol.wait" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
