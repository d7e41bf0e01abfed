"""moe_align's one-launch kernel (kernels_src/moe_align.py) against the array ops it replaces (kernels_src/moe.py's
`_align`, numpy): the DSL interpreter and Triton's interpreter, exact equality of rows and block_expert over random
routings, every slot on one expert, empty experts, one slot, the largest batch it takes, int32 and int64 ids; planted
bugs (a rank off by one, searchsorted's side) fail; moe.moe_align routes torch tensors on Triton targets to it (but
past its bounds or under LLM_ENGINE_MOE_ALIGN_KERNEL=0); the sm_90 builds spill nothing."""

from __future__ import annotations

import inspect
import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from kernels_src import moe
from kernels_src import moe_align as ma


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def want(ids, experts, block_m):
    return moe._align(np, ids.reshape(-1).astype(np.int64), experts, block_m)


def align(target, ids, experts, block_m, kernel=None):
    flat = ids.reshape(-1)
    n_blocks = moe.max_blocks(flat.shape[0], experts, block_m)
    if kernel is None:
        return tuple(host(a) for a in ma.moe_align(dev(flat, target), experts, block_m, n_blocks, target))
    rows, be = np.empty(n_blocks * block_m, np.int32), np.empty(n_blocks, np.int32)
    kern = ma.compile(kernel, "numpy", num_warps=ma.NUM_WARPS, BLOCK_M=block_m, **ma.tiles(experts))
    kern[1](flat, rows, be, flat.shape[0], experts, rows.shape[0], n_blocks)
    return rows, be


def check(got, ref):
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    assert got[0].dtype == np.int32 and got[1].dtype == np.int32


def routing(rng, tokens, top_k, experts, used=None):
    """A router's choice: top_k distinct experts a token, drawn from `used` (default: all)."""
    pool = np.arange(experts) if used is None else np.asarray(used)
    return np.stack([rng.choice(pool, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)


CASES = [  # (tokens, top_k, experts, block_m)
    (1, 1, 8, 16),  # one slot
    (7, 2, 8, 16),
    (64, 8, 128, 16),  # Qwen3-30B-A3B's decode batch of 64
    (64, 8, 128, 64),
    (48, 1, 128, 16),
    (9, 8, 256, 64),
    (13, 8, 8, 64),  # every expert, several blocks of some
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tokens,top_k,experts,block_m", CASES)
def test_random_routings(target, tokens, top_k, experts, block_m, rng):
    ids = routing(rng, tokens, top_k, experts)
    check(align(target, ids, experts, block_m), want(ids, experts, block_m))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("block_m", [16, 64])
def test_one_expert_and_empty_experts(target, block_m, rng):
    """Every slot on one expert (its run many blocks long); then two experts used of 128, the rest empty (their ends
    repeat, so the blocks past the used ones take searchsorted's clamp)."""
    ids = np.full((37, 1), 5, np.int32)
    check(align(target, ids, 8, block_m), want(ids, 8, block_m))
    ids = routing(rng, 40, 2, 128, used=[3, 127])
    check(align(target, ids, 128, block_m), want(ids, 128, block_m))
    ids = np.full((3, 1), 127, np.int32)  # only the last expert
    check(align(target, ids, 128, block_m), want(ids, 128, block_m))


@pytest.mark.parametrize("target", TARGETS)
def test_int64_ids_and_the_largest_batch(target, rng):
    """torch.topk's int64 ids, and 1,024 slots over 256 experts (the bounds), skewed to a few experts."""
    ids = routing(rng, 128, 8, 256).astype(np.int64)
    ids[:, :3] = rng.integers(0, 4, (128, 3))  # repeats within a token do not matter to the grouping
    check(align(target, ids, 256, 16), want(ids, 256, 16))


def _mutant(old: str, new: str):
    """The kernel with one planted bug, traced from its edited source (the DSL traces any function)."""
    src = inspect.getsource(ma.moe_align_kernel)
    assert src.count(old) == 1
    scope = dict(vars(ma))
    exec(compile(src.replace(old, new), ma.__file__, "exec"), scope)  # noqa: S102
    return scope["moe_align_kernel"]


@pytest.mark.parametrize("old,new", [("ss[None, :] < ss[:, None]", "ss[None, :] <= ss[:, None]"),  # rank + 1
                                     ("return base + tl.sum", "return base + 0 * tl.sum"),  # tiles before forgotten
                                     ("ends[None, :] <= (b", "ends[None, :] < (b")])  # searchsorted left
def test_planted_bugs_fail(old, new, rng):
    ids = routing(rng, 40, 4, 16, used=range(6))  # 160 slots: three tiles of 64
    assert_equal = (lambda got: check(got, want(ids, 16, 16)))
    assert_equal(align("numpy", ids, 16, 16, kernel=ma.moe_align_kernel))  # the unedited kernel, the same way
    with pytest.raises(AssertionError):
        assert_equal(align("numpy", ids, 16, 16, kernel=_mutant(old, new)))


@pytest.mark.skipif(not HAS_TRITON, reason="torch is not installed")
def test_moe_align_routes_torch_on_triton_targets(monkeypatch, rng):
    import torch

    calls = []
    real = ma.moe_align
    monkeypatch.setattr(ma, "moe_align", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    ids = routing(rng, 8, 8, 128)
    t_ids = torch.from_numpy(ids).long()
    for target in ("triton-interpret", None, "numpy"):
        got = moe.moe_align(t_ids, 128, 16, target)
        check(tuple(g.numpy() for g in got), want(ids, 128, 16))
    assert calls == [64]  # the Triton target only
    big = routing(rng, 129, 8, 128)  # 1,032 slots: past the kernel's bound, the array ops
    check(tuple(g.numpy() for g in moe.moe_align(torch.from_numpy(big), 128, 16, "triton-interpret")),
          want(big, 128, 16))
    monkeypatch.setattr(moe, "ALIGN_KERNEL", False)
    moe.moe_align(t_ids, 128, 16, "triton-interpret")
    assert calls == [64]


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("experts,block_m", [(128, 16), (256, 64), (8, 16)])
def test_aot_sm90(experts, block_m, tmp_path, monkeypatch, capsys):
    """The kernel for an H200 without a GPU: the barrier after the fill, the grid-dependency wait, nothing spilled;
    prints registers."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from tools.sass_mix import loop_mix

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    sig = dict(ids="*i32", rows="*i32", block_expert="*i32", n_slots="i32", n_experts="i32", n_rows="i32",
               n_blocks="i32")
    k = ma.compile(ma.moe_align_kernel, "triton", num_warps=ma.NUM_WARPS, launch_pdl=True, BLOCK_M=block_m, PDL=True,
                   **ma.tiles(experts))
    c = aot_compile(k.trace(signature=sig), arch=90, num_warps=ma.NUM_WARPS)
    assert "bar.sync" in c.asm["ptx"] and "griddepcontrol.wait" in c.asm["ptx"]
    mix = loop_mix(c.asm["cubin"])
    with capsys.disabled():
        print(f"\nmoe_align {experts} experts, BLOCK_M {block_m}, {ma.tiles(experts)}: {mix.registers} registers, "
              f"stack {mix.stack}")
    assert mix.stack == 0 and _stack_bytes(c.asm["cubin"], tmp_path) == 0


def test_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) through the CPU fiber oracle: the barrier between the fill and the
    scatter, experts in two chunks, slots over several tiles."""
    ids = routing(rng, 24, 4, 128, used=range(0, 128, 5))
    check(align("simt-cpu", ids, 128, 16), want(ids, 128, 16))
