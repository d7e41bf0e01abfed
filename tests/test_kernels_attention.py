"""Paged attention kernels (decode with split-K, prefill / chunked prefill) on shuffled block tables, with every
cache slot outside the contexts and every output poisoned: the DSL interpreter and Triton's interpreter against
the numpy reference of the `core.batch` contract, and Triton AOT builds for sm_90 at the realistic configuration."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp

TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float16: dict(rtol=3e-3, atol=3e-3)}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # stable across runs


def paged_cache(rng, ctx_lens, n_kv, d, bs, dtype):
    """Caches whose only finite slots hold the contexts, through shuffled block tables (unused entries -1)."""
    need = [-(-int(c) // bs) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks)
    tables = np.full((len(ctx_lens), max(need) + 1), -1, np.int32)
    kc, vc = (np.full((num_blocks, bs, n_kv, d), np.nan, dtype) for _ in range(2))
    used = 0
    for b, (n, c) in enumerate(zip(need, ctx_lens, strict=True)):
        tables[b, :n] = perm[used:used + n]
        used += n
        j = np.arange(c)
        for cache in (kc, vc):
            cache[tables[b, j // bs], j % bs] = rng.standard_normal((c, n_kv, d)).astype(dtype)
    return kc, vc, tables


def close(got, want, dtype, widen: float = 1.0):
    got = host(got).astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **{k: v * widen for k, v in TOL[dtype].items()})


# --- decode ------------------------------------------------------------------------------------------------------

DECODE_CASES = {  # hq, hkv, d, block_size, context lens, partition, block_n, window, softcap
    "gqa4_split": (8, 2, 32, 8, [1, 37, 70], 32, 16, None, None),
    "mha_d24": (2, 2, 24, 4, [5, 16, 19], 512, 16, None, None),
    "window_softcap_split": (4, 1, 16, 32, [50, 9], 16, 16, 20, 30.0),
    "many_parts": (4, 2, 16, 8, [600, 3, 250], 16, 16, None, None),  # 38 partitions: the reduce takes 3 rounds
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_paged_decode(target, dtype, case, rng):
    hq, hkv, d, bs, ctx, partition, block_n, window, cap = DECODE_CASES[case]
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, dtype)
    ctx = np.array(ctx, np.int32)
    q = rng.standard_normal((len(ctx), hq + 1, d)).astype(dtype)[:, :hq]  # a strided view, as out of a qkv split
    n_parts = pa.num_partitions(ctx.max(), partition)
    ws = [dev(np.full(s, np.nan, np.float32), target) for s in [(len(ctx), hq, n_parts)] * 2 + [(*q.shape[:2],
                                                                                                 n_parts, d)]]
    out = dev(np.full(q.shape, np.nan, dtype), target)
    pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target), 0.3,
                    sliding_window=window, softcap=cap, out=out, partition=partition, block_n=block_n,
                    workspace=ws if n_parts > 1 else None, target=target)
    close(out, pa.paged_decode_ref(q, kc, vc, tables, ctx, 0.3, sliding_window=window, softcap=cap), dtype)
    if n_parts > 1:  # split-K really split: each sequence's partitions hold partial results
        for b, c in enumerate(ctx):
            assert np.isfinite(host(ws[0])[b, :, :pa.num_partitions(c, partition)]).all()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("max_parts, window", [(2, None), (3, 50)])
def test_paged_decode_capped_grid_serves_longer_contexts(target, max_parts, window, rng):
    """A grid of max_parts partitions (as a CUDA graph fixes it) serves contexts far past max_parts * partition:
    each context is cut into at most max_parts shares, multiples of block_n, each holding keys; sliding window too."""
    lens = [300, 20, 129, 47]
    kc, vc, tables = paged_cache(rng, lens, 1, 16, 8, np.float32)
    q, ctx = rng.standard_normal((len(lens), 2, 16)).astype(np.float32), np.array(lens, np.int32)
    ws = [dev(np.full(s, np.nan, np.float32), target) for s in [(len(lens), 2, max_parts)] * 2 + [(len(lens), 2,
                                                                                                   max_parts, 16)]]
    out = pa.paged_decode(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target),
                          0.3, sliding_window=window, max_context=10_000, max_parts=max_parts, partition=16,
                          block_n=16, workspace=ws, target=target)
    close(out, pa.paged_decode_ref(q, kc, vc, tables, ctx, 0.3, sliding_window=window), np.float32)
    den = host(ws[1])
    for b, c in enumerate(lens):
        plen = max(16, -(-c // (16 * max_parts)) * 16)
        used = -(-c // plen)
        assert used <= max_parts and (used == max_parts or c <= max_parts * 16)
        if window is None:  # every partition that holds keys has weight (a window may mask whole partitions)
            assert (den[b, :, :used] > 0).all()


def test_paged_decode_bf16_on_the_interpreter(rng):
    torch = pytest.importorskip("torch")
    kc, vc, tables = paged_cache(rng, [40, 3], 2, 16, 8, np.float32)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    ctx = np.array([40, 3], np.int32)
    bf = lambda a: torch.from_numpy(a).bfloat16()
    out = torch.full((2, 4, 16), float("nan"), dtype=torch.bfloat16)
    pa.paged_decode(bf(q), bf(kc), bf(vc), torch.from_numpy(tables), torch.from_numpy(ctx), 0.25, out=out,
                    partition=16, block_n=16)
    r = lambda a: bf(a).float().numpy()
    np.testing.assert_allclose(out.float().numpy(), pa.paged_decode_ref(r(q), r(kc), r(vc), tables, ctx, 0.25),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["paged_decode", "paged_prefill"])
def test_attend_issues_v_with_k(name):
    """Each key tile's K and V loads come before its first dot: the targets that issue loads in program order (Metal,
    the CUDA C twin, Triton where it does not pipeline the loop) then overlap the two round trips."""
    from kernels_src.registry import get

    loop = next(op for op in get(name).trace().body.ops if op.opcode == "for")
    order = [op.opcode for op in loop.body.ops if op.opcode in ("load", "dot")]
    assert order[:4] == ["load", "load", "load", "dot"], order  # table entries, K, V, then QK


# --- prefill and chunked prefill ---------------------------------------------------------------------------------

PREFILL_CASES = {  # hq, hkv, d, block_size, new tokens, context lens, block_m, window, softcap
    # a fresh prompt, a decode token, a chunk after 18 cached tokens, a sequence with nothing new this step
    "chunked_gqa4": (8, 2, 32, 8, [5, 1, 12, 0], [5, 20, 30, 3], 16, None, None),
    "mha_d24": (3, 3, 24, 4, [17, 3], [17, 40], 16, None, None),
    "window_softcap": (4, 2, 16, 32, [20, 6], [26, 6], 32, 7, 10.0),
    # MLA's 576-wide latent heads: tiles shrunk to fit shared memory hold half a group of 32 heads each
    "wide_heads_part_group": (32, 1, 576, 8, [3, 1], [3, 20], 64, None, None),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_paged_prefill(target, dtype, case, rng):
    hq, hkv, d, bs, q_lens, ctx, block_m, window, cap = PREFILL_CASES[case]
    kc, vc, tables = paged_cache(rng, ctx, hkv, d, bs, dtype)
    ctx = np.array(ctx, np.int32)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((qs[-1], hq, d)).astype(dtype)
    out = dev(np.full(q.shape, np.nan, dtype), target)
    pp.paged_prefill(dev(q, target), dev(kc, target), dev(vc, target), dev(tables, target), dev(ctx, target),
                     dev(qs, target), 0.3, sliding_window=window, softcap=cap, out=out, block_m=block_m, block_n=16,
                     target=target)
    want = pp.paged_prefill_ref(q, kc, vc, tables, ctx, qs, 0.3, sliding_window=window, softcap=cap)
    close(out, want, dtype, widen=3.0 if d > 256 else 1.0)  # fp32 sums over 576 products: 1.5e-5 seen


def test_prefill_tiles_fit_shared_memory():
    """Heads up to 256 wide keep 64 x 64 tiles and whole groups; MLA's 576 (1024 padded) shrink to 16 x 16,
    also for V3's 128-head group, which a tile then holds in part."""
    assert pp.prefill_tiles(4, 128) == (64, 64) and pp.prefill_tiles(8, 256) == (64, 64)
    for group in (16, 128):
        assert pp.prefill_tiles(group, 1024) == (16, 16)
    assert pp.prefill_tiles(32, 512) == (64, 16)  # keys shrink first


def test_reference_is_the_ir_contract(rng):
    """Our reference agrees with the IR interpreter's paged attention (the contract every backend follows)."""
    from ir.interpreter import KVCache, paged_attention

    kc, vc, tables = paged_cache(rng, [9, 30], 2, 16, 8, np.float32)
    ctx, qs = np.array([9, 30], np.int32), np.array([0, 9, 13], np.int32)
    q = rng.standard_normal((13, 4, 16)).astype(np.float32)
    none = np.zeros((13, 2, 16), np.float32)
    for window, cap in [(None, None), (5, 20.0)]:
        want = paged_attention(q, none, none, np.full(13, -1), tables, ctx, qs, cache=KVCache([kc], [vc], 8),
                               layer=0, scale=0.3, sliding_window=window, softcap=cap)
        got = pa.paged_attention_ref(q, kc, vc, tables, ctx, qs, 0.3, sliding_window=window, softcap=cap)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- ahead-of-time builds for sm_90 at the realistic configuration -----------------------------------------------

AOT_CASES = {  # registry entry, constexpr overrides, signature overrides
    "decode_split_bf16": ("paged_decode", {}, {}),
    "decode_single_softcap_fp16": ("paged_decode", dict(SPLIT=False, SOFTCAP=True),
                                   dict(q="*fp16", k_cache="*fp16", v_cache="*fp16", out="*fp16")),
    "decode_reduce": ("paged_decode_reduce", {}, {}),
    "prefill_bf16": ("paged_prefill", {}, {}),
    "prefill_gqa8_d64_softcap": ("paged_prefill", dict(GROUP=8, HEAD_DIM=64, BLOCK_D=64, SOFTCAP=True), {}),
    # DeepSeek-V2-Lite's latent heads at the launcher's tiles (64 x 64 asked 655,872 bytes on the H200)
    "prefill_mla_fp16": ("paged_prefill", dict(GROUP=16, HEAD_DIM=576, BLOCK_D=1024, BLOCK_M=16, BLOCK_N=16),
                         dict(q="*fp16", k_cache="*fp16", v_cache="*fp16", out="*fp16")),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("case", list(AOT_CASES))
def test_aot_sm90(case, tmp_path, monkeypatch):
    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import get

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    name, consts, sig = AOT_CASES[case]
    compiled = aot_compile(get(name).trace(signature=sig, **consts), arch=90)
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 1000
    if name == "paged_prefill":
        assert compiled.metadata.shared <= pp.SMEM_BUDGET
