"""The integer-group GEMM (kernels_src/int_group_gemm.py) on random valid blocks, on the DSL's interpreter and
Triton's: against x @ ((q - z) * s).T in float64 from the packer's own q, scales and zero points, and against the
numpy dequantizer's reference; widths 4 and 8, groups of 32 to a whole row (not a power of two too), symmetric and
asymmetric, 9-64 rows, odd N, row counts of groups off the step, split-K on and off, fp32 / fp16 / bf16 x, outputs
poisoned with NaN first. Planted decoding bugs (nibble order, zero point, group) must fail the check; Triton AOT
builds for sm_90 at Llama-3-8B's shapes use wgmma and spill nothing; the SIMT lowering runs on the CPU oracle."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot

from ir.formats import int_groups
from kernels_src import int_group_gemm as igm
from kernels_src.dsl import launch as dsl_launch

TOL = {np.float32: 1e-5, np.float16: 2e-3}  # of the largest output (fp16: W rounded to fp16 for the dot, y too)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def quantized(rng, n: int, k: int, bits: int, group: int, sym: bool):
    """(blocks, x @ W.T's float64 W from q, fp16-exact scales and zero points; symmetric: z = 2^(bits-1))."""
    q = rng.integers(0, 1 << bits, (n, k))
    s = rng.uniform(0.5, 2.0, (n, k // group)).astype(np.float16).astype(np.float32) / np.sqrt(k)
    z = np.full_like(q[:, ::group], 1 << (bits - 1)) if sym else rng.integers(0, 1 << bits, (n, k // group))
    w64 = (q - np.repeat(z, group, 1)) * np.repeat(s.astype(np.float64), group, 1)
    return int_groups.pack(q, s, z, bits, group), w64


def run(target, x, w, bits, group, dtype=np.float32, **kw):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, dtype), target)
    assert igm.int_group_matmul(dev(x.astype(dtype), target), dev(w, target), bits, group, out=out, target=target,
                                **kw) is out
    return host(out)


def close(got, want, tol: float):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "outputs left unwritten (NaN) or NaN computed"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


# (bits, group, K, rows, symmetric, split_k): whole groups a step (2 or 4 of 32/64), 3 groups (a step each), a group
# of 128 in one step, per-channel rows of 96 and 160 (32-input slices of one group), split-K over uneven steps
CASES = [(4, 32, 128, 9, False, 1), (4, 64, 256, 17, True, 2), (4, 32, 96, 17, False, 2), (4, 128, 256, 64, False, 1),
         (4, 96, 96, 9, True, 3), (8, 32, 128, 17, False, 1), (8, 128, 384, 9, False, 2), (8, 160, 160, 64, True, 2)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k,m,sym,split", CASES)
def test_matches_references(target, bits, group, k, m, sym, split, rng):
    matches_references(target, rng, bits, group, k, m, sym, split_k=split)


def matches_references(target, rng, bits: int, group: int, k: int, m: int, sym: bool, **kw) -> None:
    """The launcher (kw: its variant and tiles) on 37 rows of W (one ragged N tile) and fp32 x against x @ W.T in
    float64 from the packer's own q, scales and zero points, and against the numpy dequantizer's reference."""
    w, w64 = quantized(rng, 37, k, bits, group, sym)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = run(target, x, w, bits, group, **kw)
    close(got, x.astype(np.float64) @ w64.T, TOL[np.float32])
    close(got, igm.int_group_matmul_ref(x, w, bits, group), TOL[np.float32])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("opts", [dict(swap=False, block_n=16), dict(block_m=32, block_n=32, groups=1),
                                  dict(sub=32, split_k=4)])
def test_tiles(target, opts, rng):
    """x @ W.T instead of W @ x.T, narrower tiles and a group a step, a 128-group in 32-input slices over 4 splits."""
    bits, group, k = (4, 128, 512) if "sub" in opts else (4, 32, 128)
    w, w64 = quantized(rng, 29, k, bits, group, False)
    x = rng.standard_normal((18, k)).astype(np.float32)
    close(run(target, x, w, bits, group, **opts), x.astype(np.float64) @ w64.T, TOL[np.float32])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits", [4, 8])
def test_fp16(target, bits, rng):
    w, _ = quantized(rng, 21, 256, bits, 64, False)
    x = rng.standard_normal((12, 256)).astype(np.float16)
    want = igm.int_group_matmul_ref(x.astype(np.float32), w, bits, 64)
    close(run(target, x, w, bits, 64, np.float16), want, TOL[np.float16])


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 x needs torch")
def test_bf16(rng):
    """bf16 x and y on the DSL interpreter (Triton's interpreter has no bf16): W rounded to bf16 for the dot."""
    import torch

    w, w64 = quantized(rng, 19, 256, 4, 128, False)
    x = torch.from_numpy(rng.standard_normal((10, 256)).astype(np.float32)).bfloat16()
    out = torch.full((10, 19), float("nan"), dtype=torch.bfloat16)
    igm.int_group_matmul(x, w, 4, 128, out=out)
    close(out.float().numpy(), x.double().numpy() @ w64.T, 1.5e-2)


def test_simt_cpu(rng):
    """The SIMT lowering (the CPU oracle of the Metal and CUDA C emitters), split-K's reduce included."""
    w, w64 = quantized(rng, 19, 128, 4, 32, False)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    close(run("simt-cpu", x, w, 4, 32, block_n=16, split_k=2), x.astype(np.float64) @ w64.T, TOL[np.float32])


PLANTED = {  # a decoding bug -> the module attribute that carries it
    "nibble order": ("_shifts", lambda BITS: (32 // BITS - 1 - igm.tl.arange(0, 32 // BITS)) * BITS),
    "zero point off by one": ("_decode", lambda q, scale, bias: q.to(igm.tl.float32) * scale + bias + scale),
    "zero point ignored": ("_decode", lambda q, scale, bias: q.to(igm.tl.float32) * scale),
}


@pytest.mark.parametrize("bug", PLANTED)
@pytest.mark.parametrize("sym", [False, True])
def test_planted_bug_fails(bug, sym, rng, monkeypatch):
    planted_fails(rng, monkeypatch, igm, *PLANTED[bug], sym=sym, variant="blocked")  # the bugs are blocked's decode


def planted_fails(rng, monkeypatch, module, attr: str, planted, sym: bool = False, **kw) -> None:
    """module.attr replaced by a planted decoding bug: the launcher's output (kw: its variant) fails the float64
    check it passes without the bug (groups of 32, 4 bits)."""
    w, w64 = quantized(rng, 13, 128, 4, 32, sym)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    close(run("numpy", x, w, 4, 32, **kw), x.astype(np.float64) @ w64.T, TOL[np.float32])
    monkeypatch.setattr(dsl_launch, "_kernels", {})  # traced afresh with the bug
    monkeypatch.setattr(module, attr, planted)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(run("numpy", x, w, 4, 32, **kw), x.astype(np.float64) @ w64.T, TOL[np.float32])


def test_scales_of_the_next_group_fail(rng):
    """Blocks whose scales are rolled one group along the row (a wrong group index) fail the same check."""
    w, w64 = quantized(rng, 13, 128, 4, 32, False)
    qb, s, b = int_groups.split(w, 4, 32, 13, 128)
    q = int_groups.unpack_q(qb, 4)
    bad = int_groups.pack(q, np.roll(s, 1, 1), np.rint(-b / s).astype(np.int64), 4, 32)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(run("numpy", x, bad, 4, 32), x.astype(np.float64) @ w64.T, TOL[np.float32])


def test_errors_are_named(rng):
    w, _ = quantized(rng, 3, 96, 4, 96, False)
    x = np.zeros((9, 96), np.float32)
    with pytest.raises(ValueError, match="does not tile groups of 96"):
        igm.int_group_matmul(x, w, 4, 96, sub=64)
    with pytest.raises(ValueError, match="does not tile groups of 96"):
        igm.int_group_matmul(x, w, 4, 96, groups=2)
    with pytest.raises(ValueError, match=r"do not hold \[3, 128\]"):
        igm.int_group_matmul(np.zeros((9, 128), np.float32), w, 4, 96)
    with pytest.raises(ValueError, match="contiguous rows"):
        igm.int_group_matmul(np.zeros((9, 192), np.float32)[:, ::2], w, 4, 96)
    with pytest.raises(ValueError, match=r"is not \[9, 3\]"):
        igm.int_group_matmul(x, w, 4, 96, out=np.zeros((9, 4), np.float32))
    assert igm.int_group_matmul(np.zeros((0, 96), np.float32), w, 4, 96).shape == (0, 3)


def test_default_tiles(monkeypatch):
    """The rule (TUNED aside): row tiles by bucket; whole groups a step up to 128 inputs; the 16-row down projection
    (N 4096, K 14336) splits K to fill 132 SMs; 256 rows take 128-row tiles. A TUNED entry then takes over."""
    swept = igm.TUNED[(4, 128, 16, 4096, 14336)]
    monkeypatch.setattr(igm, "TUNED", {})
    assert igm.step_shape(32, 4096) == (32, 4) and igm.step_shape(32, 96) == (32, 1)
    assert igm.step_shape(128, 4096) == (128, 1) and igm.step_shape(4096, 4096) == (128, 1)
    assert igm.step_shape(96, 96) == (32, 1) and igm.step_shape(64, 192) == (64, 1)
    for m, bm in ((9, 16), (16, 16), (17, 32), (64, 64), (65, 128), (256, 128)):
        assert igm.default_tiles(m, 14336, 4096, 4, 128)["BLOCK_M"] == bm
    down = igm.default_tiles(16, 4096, 14336, 4, 128)
    assert down["SPLIT"] > 1 and down["SPLIT"] * 4096 // down["BLOCK_N"] >= 2 * 132
    assert igm.default_tiles(256, 14336, 4096, 4, 128)["SPLIT"] == 1
    monkeypatch.setattr(igm, "TUNED", {(4, 128, 16, 4096, 14336): swept})
    tuned = igm.default_tiles(9, 4096, 14336, 4, 128)  # 9 rows: the 16-row bucket's entry
    assert (tuned["SPLIT"], tuned["BLOCK_N"], tuned["SWAP"]) == (swept["split_k"], swept["block_n"], swept["swap"])


@needs_aot
@pytest.mark.parametrize("m,n,k,bits,group", [(16, 14336, 4096, 4, 128), (256, 14336, 4096, 4, 128),
                                              (32, 4096, 14336, 8, 32)])
def test_aot_sm90(m, n, k, bits, group, tmp_path, monkeypatch):
    """Default tiles at Llama-3-8B's shapes build for sm_90: wgmma, the grid-dependency wait, no spills."""
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cfg = igm.default_tiles(m, n, k, bits, group)
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT")
    kern = dsl_launch.compile(igm.int_group_gemm_kernel, "triton", BITS=bits, GROUP=group, PDL=True, **cfg)
    sig = dict(w="*i32", x="*bf16", y="*bf16" if split == 1 else "*fp32")
    c = aot_compile(kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig}), arch=90,
                    num_warps=nw, num_stages=ns)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "griddepcontrol.wait" in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
