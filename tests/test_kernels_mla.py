"""The MLA decode kernel over the paged latent cache (shuffled block tables, every slot outside the contexts and
every output and scratch poisoned): the DSL interpreter, Triton's interpreter and the SIMT lowering that Metal and
CUDA C share (the CPU fiber oracle) against the numpy reference, which agrees with the IR interpreter's
latent_attention; then sm_90 AOT builds at DeepSeek-V3's shape that spill nothing."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_attention import paged_cache
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from kernels_src import mla_decode as md
from kernels_src.paged_attention import num_partitions

TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float16: dict(rtol=3e-3, atol=3e-3)}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # stable across runs


def problem(rng, heads, rank, rope, bs, ctx, dtype):
    """q [B, H, rank + rope] (a strided view of heads), the latent cache [blocks, bs, 1, rank + rope], its tables."""
    cache, _, tables = paged_cache(rng, ctx, 1, rank + rope, bs, dtype)
    q = rng.standard_normal((len(ctx), heads + 3, rank + rope)).astype(dtype)[:, :heads]
    return q, cache, tables, np.array(ctx, np.int32)


def scale(q) -> float:
    return q.shape[-1] ** -0.5  # scores of about unit spread, as a model's


def run(target, q, cache, tables, ctx, rank, **kw):
    """mla_decode on `target` with its output and (split) scratch poisoned; (out, scratch) as numpy."""
    n_parts = min(num_partitions(kw.get("max_context") or ctx.max(), kw.get("partition", 512)),
                  kw.get("max_parts") or 1 << 30)
    shapes = [(*q.shape[:2], n_parts)] * 2 + [(*q.shape[:2], n_parts, rank)]
    ws = [dev(np.full(s, np.nan, np.float32), target) for s in shapes] if n_parts > 1 else None
    out = dev(np.full((*q.shape[:2], rank), np.nan, q.dtype), target)
    md.mla_decode(dev(q, target), dev(cache, target), dev(tables, target), dev(ctx, target), scale(q), rank, out=out,
                  workspace=ws, target=target, **kw)
    return host(out), ws and [host(w) for w in ws]


def close(got, want, dtype):
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float32), want, **TOL[dtype])


CASES = {  # heads, rank, rope, block_size, context lens, partition, block_n
    "h8_r32_split": (8, 32, 8, 8, [1, 37, 70], 32, 16),
    # two head groups (the second masked), a rank chunk masked, a padding row's empty context, one partition
    "h20_r48_one_part": (20, 48, 16, 4, [5, 0, 19], 512, 16),
    "many_parts": (16, 32, 16, 8, [300, 3, 130], 16, 16),  # 19 partitions: the reduce takes 2 rounds
    "v3_width": (16, 512, 64, 16, [40, 7], 32, 32),  # DeepSeek-V3's 512 + 64: 8 rank chunks, the default tiles
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_mla_decode(target, dtype, case, rng):
    heads, rank, rope, bs, lens, partition, block_n = CASES[case]
    q, cache, tables, ctx = problem(rng, heads, rank, rope, bs, lens, dtype)
    got, ws = run(target, q, cache, tables, ctx, rank, partition=partition, block_n=block_n)
    close(got, md.mla_decode_ref(q, cache, tables, ctx, scale(q), rank), dtype)
    if ws is not None:  # split-K really split: each sequence's partitions hold partial results
        for b, c in enumerate(ctx):
            assert np.isfinite(ws[0][b, :, :num_partitions(c, partition)]).all()


@pytest.mark.parametrize("target", TARGETS)
def test_capped_grid_serves_longer_contexts(target, rng):
    """A grid of 2 partitions (as a CUDA graph fixes it) serves contexts far past 2 * partition: each context is cut
    into at most 2 shares, both holding keys."""
    q, cache, tables, ctx = problem(rng, 16, 32, 16, 8, [300, 20, 129], np.float32)
    got, ws = run(target, q, cache, tables, ctx, 32, max_context=10_000, max_parts=2, partition=16, block_n=16)
    close(got, md.mla_decode_ref(q, cache, tables, ctx, scale(q), 32), np.float32)
    assert (ws[1][[0, 2]] > 0).all()  # the two long contexts put weight in both partitions


def test_simt_lowering_on_the_cpu_oracle(rng):
    """The SIMT form Metal and CUDA C are rendered from, run by the CPU fiber oracle at the default tiles: three
    rank chunks (the last masked), a padded rope part, two head groups (the second masked), split."""
    q, cache, tables, ctx = problem(rng, 20, 80, 24, 8, [70, 7], np.float32)
    got, _ = run("simt-cpu", q, cache, tables, ctx, 80, partition=32)
    close(got, md.mla_decode_ref(q, cache, tables, ctx, scale(q), 80), np.float32)


def test_bf16_on_the_interpreter(rng):
    torch = pytest.importorskip("torch")
    q, cache, tables, ctx = problem(rng, 16, 64, 16, 8, [40, 3], np.float32)
    bf = lambda a: torch.from_numpy(a).bfloat16()
    out = md.mla_decode(bf(q), bf(cache), torch.from_numpy(tables), torch.from_numpy(ctx), 0.3, 64, partition=16,
                        block_n=16)
    r = lambda a: bf(a).float().numpy()
    np.testing.assert_allclose(out.float().numpy(), md.mla_decode_ref(r(q), r(cache), tables, ctx, 0.3, 64),
                               rtol=2e-2, atol=2e-2)


def test_reference_and_kernel_follow_the_ir_op(rng):
    """ir.interpreter's latent_attention (the contract every backend follows), fed each sequence's last latent as
    this step's token, agrees with the reference and the kernel; the reference also with a plain per-head loop."""
    from ir.interpreter import KVCache, latent_attention

    rank, lens = 32, [9, 30, 1]
    q, cache, tables, ctx = problem(rng, 8, rank, 8, 8, lens, np.float32)
    slots = np.array([tables[b, (c - 1) // 8] * 8 + (c - 1) % 8 for b, c in enumerate(lens)])
    kv = cache.reshape(-1, 1, cache.shape[-1])[slots]
    want = latent_attention(q, kv, slots, tables, ctx, np.arange(4), cache=KVCache([cache.copy()], [None], 8),
                            layer=0, scale=scale(q), value_dim=rank)
    ref = md.mla_decode_ref(q, cache, tables, ctx, scale(q), rank)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run("numpy", q, cache, tables, ctx, rank, partition=16, block_n=16)[0], want,
                               rtol=1e-5, atol=1e-5)
    keys = cache[tables[1, np.arange(30) // 8], np.arange(30) % 8, 0]  # sequence 1, head 5, by hand
    s = keys @ q[1, 5] * scale(q)
    w = np.exp(s - s.max())
    np.testing.assert_allclose(ref[1, 5], w @ keys[:, :rank] / w.sum(), rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused(rng):
    q, cache, tables, ctx = problem(rng, 4, 32, 8, 8, [5], np.float32)
    with pytest.raises(ValueError, match="does not fit the latent cache"):
        md.mla_decode(q[..., :-1], cache, tables, ctx, 0.3, 32)
    with pytest.raises(ValueError, match="rank 41"):
        md.mla_decode(q, cache, tables, ctx, 0.3, 41)


# --- ahead-of-time builds for sm_90 at DeepSeek-V3's shape -------------------------------------------------------

AOT_CASES = {  # registry entry, constexpr overrides, signature overrides
    "mla_v3_split_bf16": ("mla_decode", {}, {}),
    "mla_v3_single_fp16": ("mla_decode", dict(SPLIT=False, BLOCK_N=16),  # mla_tiles' one-partition tiles
                           dict(q="*fp16", cache="*fp16", out="*fp16")),
    "reduce_rank512": ("paged_decode_reduce", dict(HEAD_DIM=512, BLOCK_D=512, BLOCK_N=32, BLOCK_P=16), {}),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("case", list(AOT_CASES))
def test_aot_sm90_no_spills(case, tmp_path, monkeypatch):
    """The launcher's configuration (4 warps) at 128 heads of 512 + 64: tensor-core MMAs, the grid-dependency
    wait, no local memory; and the reduce at rank 512 with 16 partitions a round."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import get

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    name, consts, sig = AOT_CASES[case]
    c = aot_compile(get(name).trace(signature=sig, **consts), arch=90, num_warps=4)
    ptx = c.asm["ptx"]
    assert ".target sm_90a" in ptx and "griddepcontrol.wait" in ptx
    assert name != "mla_decode" or "mma.sync" in ptx or "wgmma.mma_async" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
