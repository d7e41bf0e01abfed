"""The prefill kernel on a grid fixed by a capacity (paged_prefill's tile_map): the same results as the batch-shaped
grid and the numpy reference of the `core.batch` contract, with unused map entries and sequences of no queries; the
tile map builder against a brute-force enumeration of every (sequence, tile) program that has rows."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_attention import PREFILL_CASES, close, paged_cache
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_kv_int8 import _deq, _int8_cache

from kernels_src import paged_prefill as pp


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def brute_map(q_lens, group: int, block_m: int) -> list[tuple[int, int]]:
    """Every (sequence, tile) whose rows hold a query, walking rows one at a time."""
    seen = []
    for b, n in enumerate(q_lens):
        for row in range(n * group):
            if (b, row // block_m) not in seen:
                seen.append((b, row // block_m))
    return seen


@pytest.mark.parametrize("group,block_m", [(1, 16), (4, 16), (3, 64), (8, 16), (32, 16)])
def test_tile_map_is_every_tile_once(group, block_m, rng):
    for _ in range(20):
        q_lens = rng.integers(0, 40, rng.integers(1, 9))
        q_lens[rng.integers(0, len(q_lens))] = 1  # a decode row
        qs = np.concatenate([[0], np.cumsum(q_lens)])
        cap = pp.tile_capacity(int(qs[-1]), len(q_lens), group, block_m)
        m = pp.build_tile_map(qs, group, block_m, cap)
        want = brute_map(q_lens, group, block_m)
        assert m.shape == (cap, 2) and m.dtype == np.int32
        assert [tuple(e) for e in m[:len(want)]] == want
        assert (m[len(want):] == (-1, 0)).all()


def test_tile_capacity_bounds_the_worst_step():
    """Every split of up to T tokens into up to S sequences fits (the worst: S - 1 one-token rows and a long one)."""
    for group, block_m in [(4, 64), (1, 16), (7, 64), (16, 16)]:
        for tokens, seqs in [(16, 4), (33, 33), (64, 8)]:
            cap = pp.tile_capacity(tokens, seqs, group, block_m)
            worst = max(len(brute_map([1] * (s - 1) + [tokens - s + 1], group, block_m)) for s in range(1, seqs + 1))
            assert worst <= cap


def test_tile_map_refuses_a_step_past_its_capacity():
    with pytest.raises(ValueError, match="exceed the map's capacity of 3"):
        pp.build_tile_map(np.array([0, 40, 41]), 4, 64, 3)


# DSL interpreter: every case in both dtypes; Triton's (slower): fp32 where the rows, padding, window and softcap vary
MAPPED_RUNS = [(c, "numpy", dt) for c in PREFILL_CASES for dt in (np.float32, np.float16)] + [
    pytest.param(c, *TARGETS[1].values, np.float32, marks=TARGETS[1].marks) for c in ("chunked_gqa4", "window_softcap")]


@pytest.mark.parametrize("case,target,dtype", MAPPED_RUNS)
def test_mapped_prefill_matches_the_reference(case, target, dtype, rng):
    """Each case with two padding sequences of no queries appended and a map of more entries than the step uses:
    the real rows as the reference has them, the padding token rows never written."""
    hq, hkv, d, bs, q_lens, ctx, block_m, window, cap = PREFILL_CASES[case]
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, dtype)
    tables = np.concatenate([tables, np.zeros((2, tables.shape[1]), np.int32)])
    ctx = np.array([*ctx, 0, 0], np.int32)
    n = sum(q_lens)
    qs = np.concatenate([[0], np.cumsum(q_lens), [n, n]]).astype(np.int32)
    q = rng.standard_normal((n + 3, hq, d)).astype(dtype)  # 3 padding token rows no sequence owns
    block_m = pp.prefill_tiles(hq // hkv, max(16, 1 << (d - 1).bit_length()), block_m)[0]
    tile_map = pp.build_tile_map(qs, hq // hkv, block_m, pp.tile_capacity(n + 3, len(ctx), hq // hkv, block_m) + 5)
    out = dev(np.full(q.shape, np.nan, dtype), target)
    pp.paged_prefill(*(dev(a, target) for a in (q, kc, vc, tables, ctx, qs)), 0.3, sliding_window=window,
                     softcap=cap, out=out, block_m=block_m, block_n=16, tile_map=dev(tile_map, target), target=target)
    want = pp.paged_prefill_ref(q[:n], kc, vc, tables[:-2], ctx[:-2], qs[:-2], 0.3, sliding_window=window,
                                softcap=cap)
    got = host(out)
    close(got[:n], want, dtype, widen=3.0 if d > 256 else 1.0)
    assert np.isnan(got[n:].astype(np.float32)).all()
    shaped = pp.paged_prefill(*(dev(a, target) for a in (q, kc, vc, tables, ctx, qs)), 0.3, sliding_window=window,
                              softcap=cap, block_m=block_m, block_n=16, target=target)
    np.testing.assert_array_equal(got[:n], host(shaped)[:n])  # the same programs: the same bits


@pytest.mark.parametrize("target", TARGETS)
def test_mapped_prefill_int8(target, rng):
    """The int8 cache's twin: a prompt, a chunk and a decode row, against the reference over dequantized caches."""
    hq, hkv, d, bs = 4, 2, 64, 4
    ctx, qlen = np.array([9, 21, 7], np.int32), np.array([9, 6, 1], np.int32)
    (kc, ks, vc, vs), tables = _int8_cache(rng, ctx, hkv, d, bs)
    qs = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]), hq, d)).astype(np.float32)
    tile_map = pp.build_tile_map(qs, 2, 16, pp.tile_capacity(int(qs[-1]), 3, 2, 16))
    out = pp.paged_prefill(*(dev(a, target) for a in (q, kc, vc, tables, ctx, qs)), 0.2, sliding_window=12,
                           block_m=16, block_n=16, k_scales=dev(ks, target), v_scales=dev(vs, target),
                           tile_map=dev(tile_map, target), target=target)
    want = pp.paged_prefill_ref(q, _deq(kc, ks), _deq(vc, vs), tables, ctx, qs, 0.2, sliding_window=12)
    np.testing.assert_allclose(host(out), want, rtol=2e-5, atol=2e-5)


def _trace(fn, **consts):
    """`fn` traced at paged_prefill's registered configuration (bf16 q, its caches int8 for the int8 twin)."""
    from kernels_src.dsl import compile
    from kernels_src.dsl.tracer import split_params
    from kernels_src.registry import get

    entry = get("paged_prefill")
    sig = {p: entry.pointers.get(p, "*fp32" if "scales" in p else "*i32" if p == "tile_map" else
                                 "fp32" if p in entry.floats else "i32") for p in split_params(fn)[0]}
    sig |= {p: "*i8" for p in ("k_cache", "v_cache") if "int8" in fn.__name__}
    return compile(fn, **(entry.constexprs | consts)).trace(signature=sig)


@pytest.mark.parametrize("fn", pp.MAPPED_KERNELS, ids=lambda f: f.__name__)
def test_mapped_kernels_wait_before_what_earlier_kernels_write(fn):
    """Under PDL only the tile map (copied in from the host before the step) is read before the wait."""
    from test_kernels_pdl import check_pdl

    check_pdl(_trace(fn, PDL=True), {"tile_map"})


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
def test_mapped_kernel_builds_for_sm90(tmp_path, monkeypatch):
    """The sm_90 build at the realistic configuration (Llama-3-8B's GQA 4, 128-wide heads), within shared memory
    (the int8 twin's program is the shaped int8 kernel's, built by test_kernels_kv_int8's cases)."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = aot_compile(_trace(pp.paged_prefill_mapped_kernel, PDL=True), arch=90)
    assert ".target sm_90a" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000
    assert compiled.metadata.shared <= pp.SMEM_BUDGET
