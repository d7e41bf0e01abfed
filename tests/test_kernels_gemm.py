"""Dequantizing GEMM over raw GGUF blocks (every format kernels_src/dequantize.py decodes) on random valid blocks:
the DSL interpreter and Triton's interpreter against x @ dequantize(W).T in float64 (our numpy dequantizer), for
2..33 rows and odd N, fp32 / fp16 / bf16 x, split-K and every tile option, outputs poisoned first; then Triton AOT
builds for sm_90 at the Llama-3-8B shapes: the dot is wgmma, nothing spills, the grid-dependency wait is there."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, k_for, padded_weights

from kernels_src import dequant_gemm as dgm
from kernels_src import dequantize as dq
from kernels_src import split_k

TOL = {np.float32: 1e-5, np.float16: 2e-3}  # of the largest output (fp16: W and y rounded to fp16)
needs_aot = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="AOT builds need triton, and TRITON_INTERPRET unset")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def close(got, want, tol: float):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "outputs left unwritten (NaN) or NaN computed"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _k(qtype: str, blocks: int) -> int:
    return k_for(qtype, blocks if qtype.endswith("K") else 4 * blocks)


def _run(target, x, w, qtype, dtype, **kw):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, dtype), target)
    y = dgm.dequant_matmul(dev(x, target), dev(w, target), qtype, out=out, target=target, **kw)
    assert y is out
    return host(out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("qtype", dq.QTYPES)
@pytest.mark.parametrize("m", [2, 9, 16, 33])
def test_dequant_matmul_interpreter(m, qtype, dtype, rng):
    """The DSL interpreter, default tiles: 33 rows take a 64-row tile, 3 N tiles of 64 with the last ragged."""
    k = _k(qtype, 3)
    w = padded_weights(rng, qtype, 131, k)
    x = rng.standard_normal((m, k)).astype(dtype)
    close(_run("numpy", x, w, qtype, dtype), dgm.dequant_matmul_ref(x, w, qtype), TOL[dtype])


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("qtype", dq.QTYPES)
@pytest.mark.parametrize("m", [9, 33])
def test_dequant_matmul_triton_interpreter(m, qtype, dtype, rng):
    k = _k(qtype, 2)
    w = padded_weights(rng, qtype, 37, k)
    x = rng.standard_normal((m, k)).astype(dtype)
    close(_run("triton-interpret", x, w, qtype, dtype), dgm.dequant_matmul_ref(x, w, qtype), TOL[dtype])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("opts", [dict(split_k=3), dict(swap=False, block_m=32, block_n=16, split_k=1),
                                  dict(blocks=1, split_k=2, block_n=32), dict(block_m=16, split_k=1)])
def test_dequant_matmul_tiles_and_split(target, qtype, opts, rng):
    """Split-K (3 splits of a 4- or 8-step row: one split short) through the reduce kernel, x @ W.T instead of
    W @ x.T, narrower tiles, a block a step, and M = 18 over two 16-row tiles."""
    k = _k(qtype, 4 if qtype.endswith("K") else 2)
    w = padded_weights(rng, qtype, 45, k)
    x = rng.standard_normal((18, k)).astype(np.float32)
    close(_run(target, x, w, qtype, np.float32, **opts), dgm.dequant_matmul_ref(x, w, qtype), TOL[np.float32])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_dequant_matmul_strides_and_unaligned_rows(qtype, rng):
    """x rows at an odd stride, W rows 2 bytes off a 16-byte boundary, y rows inside a wider buffer."""
    k = _k(qtype, 2)
    w = padded_weights(rng, qtype, 21, k, pad=6)
    x = rng.standard_normal((5, k + 3)).astype(np.float32)[:, :k]
    big = np.full((5, 30), np.nan, np.float32)
    dgm.dequant_matmul(x, w, qtype, out=big[:, 2:23])
    close(big[:, 2:23], dgm.dequant_matmul_ref(x, w, qtype), TOL[np.float32])
    assert np.isnan(big[:, :2]).all() and np.isnan(big[:, 23:]).all()


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 x needs torch")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_dequant_matmul_bf16(qtype, rng):
    """bf16 x and y on the DSL interpreter (Triton's interpreter has no bf16): W rounded to bf16 for the dot."""
    import torch

    k = _k(qtype, 2)
    w = padded_weights(rng, qtype, 19, k)
    x = torch.from_numpy(rng.standard_normal((12, k)).astype(np.float32)).bfloat16()
    out = torch.full((12, 19), float("nan"), dtype=torch.bfloat16)
    dgm.dequant_matmul(x, w, qtype, out=out)
    close(out.float().numpy(), dgm.dequant_matmul_ref(x.float().numpy(), w, qtype), 1.5e-2)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_dequant_matmul_simt_cpu(qtype, rng):
    """The SIMT lowering (the CPU oracle of the Metal and CUDA C emitters): Q6_K's narrow decoding, the split-K
    reduce, 18 rows over two row tiles."""
    k = _k(qtype, 2)
    w = padded_weights(rng, qtype, 19, k)
    x = rng.standard_normal((18, k)).astype(np.float32)
    got = _run("simt-cpu", x, w, qtype, np.float32, block_n=16, split_k=2)
    close(got, dgm.dequant_matmul_ref(x, w, qtype), TOL[np.float32])


def test_dequant_matmul_errors(rng):
    w = padded_weights(rng, "Q4_K", 4, 512)
    x = np.zeros((3, 512), np.float32)
    with pytest.raises(ValueError, match="unsupported qtype"):
        dgm.dequant_matmul(x, w, "Q9_9")
    with pytest.raises(ValueError, match="do not make a GEMM"):
        dgm.dequant_matmul(np.zeros((3, 768), np.float32), w, "Q4_K")  # rows too short
    with pytest.raises(ValueError, match="does not divide"):
        dgm.dequant_matmul(x, w, "Q4_K", blocks=4)
    assert dgm.dequant_matmul(np.zeros((0, 512), np.float32), w, "Q4_K").shape == (0, 4)


def test_default_tiles(monkeypatch):
    """The rule (TUNED's measured entries aside): row tiles by M; the down projection (N = 4096, K = 14336) splits K
    to fill 132 SMs, within the partials' budget; steps always divide a row."""
    monkeypatch.setattr(dgm, "TUNED", {})
    for qtype in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"):
        for m, bm in ((2, 16), (16, 16), (17, 32), (32, 32), (64, 64), (256, 64)):
            for n, k in ((14336, 4096), (4096, 14336), (28672, 4096), (4096, 4096)):
                t = dgm.default_tiles(qtype, m, n, k)
                blocks = k // dgm.GGUF[qtype].block_size
                assert t["BLOCK_M"] == bm and blocks % t["KB"] == 0
                assert t["SPLIT"] == 1 or 8 * t["SPLIT"] * m * n <= split_k.PART_BYTES
                assert blocks // t["KB"] // t["SPLIT"] >= split_k.MIN_SPLIT_STEPS or t["SPLIT"] == 1
        down = dgm.default_tiles(qtype, 16, 4096, 14336)
        assert down["SPLIT"] * 4096 // down["BLOCK_N"] >= 2 * split_k.SMS


# --- Triton AOT for sm_90 ----------------------------------------------------------------------------------------

def _aot(qtype: str, m: int, n: int, k: int, tmp_path):
    """The GEMM (and the reduce, when K is split) at the default tiles, built as Triton's JIT would specialize it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl.triton_target import TritonRenderer, load_function

    cfg = dgm.default_tiles(qtype, m, n, k)
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages") or 3, cfg.pop("SPLIT")
    kern = dsl_compile(dgm.dequant_gemm_kernel, "triton", QTYPE=qtype, WIDE=True, PDL=True, **cfg)
    sig = dict(w="*u8", x="*bf16", y="*bf16" if split == 1 else "*fp32")
    kir = kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig})
    div16 = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kir.params)
             if p.name in ("w", "x", "y", "w_stride", "x_stride", "y_stride")}
    fn = JITFunction(load_function(TritonRenderer().render(kir), kir.name))
    return split, triton.compile(ASTSource(fn, signature=kir.signature, attrs=div16),
                                 target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})


@needs_aot
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("m,n,k", [(16, 14336, 4096), (64, 4096, 14336)])
def test_aot_sm90(qtype, m, n, k, tmp_path, monkeypatch):
    """The blocked kernel's build at the rule's tiles (TUNED's entries may name another variant's kernel)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dgm, "TUNED", {})
    split, c = _aot(qtype, m, n, k, tmp_path)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "griddepcontrol.wait" in ptx
    assert "cp.async" in ptx  # block and x loads pipelined across steps
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
    assert split > 1 or n > 4096


@needs_aot
def test_aot_sm90_reduce(tmp_path, monkeypatch):
    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kern = dsl_compile(split_k.dequant_gemm_reduce_kernel, "triton", SPLIT=8, BLOCK=split_k.REDUCE_BLOCK, PDL=True)
    kir = kern.trace(signature=dict(part="*fp32", y="*bf16", n_rows="i32", y_stride="i32", split_stride="i32"))
    c = aot_compile(kir, arch=90, num_warps=4)
    assert "griddepcontrol.wait" in c.asm["ptx"] and _stack_bytes(c.asm["cubin"], tmp_path) == 0


def test_tuned_overrides_default_tiles(monkeypatch, rng):
    """A TUNED entry (tools/sweep_gemm.py's output) replaces the rule for its (qtype, row bucket, n, k) only, and the
    launch at the tuned tiles still matches the reference."""
    k = _k("Q4_K", 4)
    monkeypatch.setitem(dgm.TUNED, ("Q4_K", 32, 45, k), dict(block_n=16, split_k=2, swap=False, num_stages=2))
    t = dgm.default_tiles("Q4_K", 20, 45, k)
    assert (t["BLOCK_N"], t["SPLIT"], t["SWAP"], t["num_stages"], t["BLOCK_M"]) == (16, 2, False, 2, 32)
    assert dgm.default_tiles("Q4_K", 16, 45, k)["BLOCK_N"] == 64  # another bucket: the rule
    w = padded_weights(rng, "Q4_K", 45, k)
    x = rng.standard_normal((20, k)).astype(np.float32)
    close(_run("numpy", x, w, "Q4_K", np.float32), dgm.dequant_matmul_ref(x, w, "Q4_K"), TOL[np.float32])
