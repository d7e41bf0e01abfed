"""Dequantizing rows of raw GGUF blocks (all ten quantized types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) on random
valid blocks: the DSL interpreter and Triton's interpreter against our numpy dequantizer, bit for bit in fp32 / fp16
/ bf16 (the kernel's products are the reference's), and against gguf-py's own dequantizer; with repeated row ids,
tiles off the row, unaligned and strided rows, and poisoned outputs; Triton AOT builds for sm_90 with 16-byte stores
and no spills."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_gguf_quants import assert_matches, gguf_ref
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, k_for, needs_aot, padded_weights

from kernels_src import dequantize as dq
from kernels_src.registry import REGISTRY

R, N = 5, 9  # row ids drawn (with repeats) from a matrix of N rows


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # stable across runs


def small_k(qtype: str) -> int:
    """3 super-blocks or 20 blocks: either way off the power-of-two tile, so a tile's last blocks go unstored."""
    return k_for(qtype, 3 if qtype.endswith("K") else 20)


def row_ids(rng, dtype=np.int32) -> np.ndarray:
    ids = rng.integers(0, N, R).astype(dtype)
    ids[-1] = ids[0]  # a repeat, as a prompt repeats tokens
    return ids


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("qtype", dq.QTYPES)
def test_dequantize_rows(target, dtype, qtype, rng):
    k = small_k(qtype)
    w = padded_weights(rng, qtype, N, k)
    rows = row_ids(rng, np.int64 if dtype == np.float16 else np.int32)
    out = dev(np.full((R, k), np.nan, dtype), target)
    dq.dequantize_rows(dev(w, target), dev(rows, target), qtype, k, out=out, target=target)
    np.testing.assert_array_equal(host(out), dq.dequantize_rows_ref(w, rows, qtype, k).astype(dtype))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", dq.QTYPES)
def test_matches_gguf_dequantizer(target, qtype, rng):
    """gguf-py's dequantizer (independent of ours) on the rows the kernel decoded; its order of fp32 operations may
    differ from ggml's, so within assert_matches' 1e-6 (relative) rather than bit for bit."""
    k = small_k(qtype)
    w = padded_weights(rng, qtype, N, k)
    rows = row_ids(rng)
    out = dev(np.full((R, k), np.nan, np.float32), target)
    dq.dequantize_rows(dev(w, target), dev(rows, target), qtype, k, out=out, target=target)
    assert_matches(host(out), gguf_ref(np.ascontiguousarray(w[rows]), qtype, (R, k)))


@pytest.mark.parametrize("qtype", dq.QTYPES)
def test_tiles_unaligned_and_strided(qtype, rng):
    """Several programs a row (the last partial), rows 2 bytes off a 4-byte boundary, out rows at a padded stride."""
    k = small_k(qtype)
    w = padded_weights(rng, qtype, N, k, pad=6)
    rows = row_ids(rng)
    big = np.full((R, k + 3), np.nan, np.float32)
    dq.dequantize_rows(w, rows, qtype, k, out=big[:, :k], blocks=2 if qtype.endswith("K") else 8)
    np.testing.assert_array_equal(big[:, :k], dq.dequantize_rows_ref(w, rows, qtype, k))
    assert np.isnan(big[:, k:]).all()


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 outputs need torch")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_bf16_and_allocated_outputs(target, qtype, rng):
    import torch

    k = small_k(qtype)
    w = torch.from_numpy(padded_weights(rng, qtype, N, k))
    rows = torch.from_numpy(row_ids(rng, np.int64))
    got = dq.dequantize_rows(w, rows, qtype, k, dtype=torch.bfloat16 if qtype == "Q4_K" else "bfloat16",
                             target=target)  # the CUDA backend passes torch dtypes
    ref = torch.from_numpy(dq.dequantize_rows_ref(w.numpy(), rows.numpy(), qtype, k))
    assert got.dtype == torch.bfloat16
    if target == "numpy":
        assert torch.equal(got, ref.bfloat16())
    else:  # Triton's interpreter converts fp32 to bf16 by truncation: rounded toward zero, less than a bf16 ulp off
        err = (got.float() - ref).abs()
        assert (got.float().abs() <= ref.abs()).all() and (err <= ref.abs() * 2.0 ** -7).all()


def test_launcher_checks(rng):
    w = padded_weights(rng, "Q4_K", N, 256)
    out = dq.dequantize_rows(w, np.array([3], np.int32), "q4_k", 256)  # qtype in any case; fp32 by default
    assert out.dtype == np.float32 and out.shape == (1, 256)
    assert dq.dequantize_rows(w, np.array([3], np.int32), "Q4_K", 256, dtype=np.float16).dtype == np.float16
    assert dq.dequantize_rows(w, np.zeros(0, np.int32), "Q4_K", 256).shape == (0, 256)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        dq.dequantize_rows(w, np.zeros(1, np.int32), "Q4_K", 256, dtype="int32")
    with pytest.raises(ValueError, match="unsupported qtype"):
        dq.dequantize_rows(w, np.zeros(1, np.int32), "IQ4_XS", 256)
    with pytest.raises(ValueError, match="do not hold rows"):
        dq.dequantize_rows(w, np.zeros(1, np.int32), "Q4_K", 512)  # rows of 144 bytes hold 256 elements
    with pytest.raises(ValueError, match="2-byte aligned"):
        dq.dequantize_rows(np.zeros((2, 145), np.uint8)[:, 1:], np.zeros(1, np.int32), "Q4_K", 256)
    with pytest.raises(IndexError):  # a row id past the matrix: the interpreter refuses to read it
        dq.dequantize_rows(w, np.array([N + 2], np.int32), "Q4_K", 256)


@needs_aot
@pytest.mark.parametrize("qtype", dq.QTYPES)
def test_aot_sm90(qtype, tmp_path, monkeypatch):
    """The registry configuration builds for sm_90 with 16-byte stores of bf16 and no spills, also with the 16-byte
    alignment the JIT specializes on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels_src.dsl.triton_target import TritonRenderer, aot_compile, load_function

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    k = REGISTRY[f"dequantize_{qtype.lower()}"].trace()
    assert ".target sm_90a" in aot_compile(k, arch=90).asm["ptx"]
    fn = JITFunction(load_function(TritonRenderer().render(k), k.name))
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(k.params) if p.name != "n_blocks"}
    compiled = triton.compile(ASTSource(fn, signature=k.signature, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert "st.global.v4.b32" in compiled.asm["ptx"]
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
