"""Dequantizing GEMV over raw GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) on random valid blocks: the DSL
interpreter and Triton's interpreter against x @ dequantize(W).T, Triton AOT builds for sm_90; then the kernel
registry and tools/dump_kernel over every registered kernel."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_gguf_quants import random_raw
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host

from ir.formats.gguf_quants import QTYPES as GGUF_TYPES
from ir.formats.gguf_quants import row_bytes
from kernels_src import dequant_gemv as dg
from kernels_src.registry import REGISTRY

TOL = {np.float32: 1e-5, np.float16: 2e-3}  # of the largest output: sums of thousands of terms ~50 in size
needs_aot = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="AOT builds need triton, and TRITON_INTERPRET unset")


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # stable across runs


def padded_weights(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """Random valid blocks [n, row_bytes], as a view into a buffer whose padding bytes (past each row, and two
    rows past the last) are 0xFF: read, they decode to NaN scales or wrong values."""
    rb = row_bytes(qtype, k)
    big = np.full((n + 2, rb + 6), 0xFF, np.uint8)
    big[:n, :rb] = random_raw(qtype, (n, k), rng, 0.05).reshape(n, rb)
    return big[:n, :rb]


def close(got, want, dtype=np.float32):
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(want).max())


def k_for(qtype: str, blocks: int) -> int:
    return blocks * GGUF_TYPES[qtype].block_size


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("qtype", dg.QTYPES)
@pytest.mark.parametrize("m,n,blocks", [(1, 5, 3), (3, 9, 18)])  # rows and chunks off the tiles
def test_dequant_gemv(target, dtype, qtype, m, n, blocks, rng):
    k = k_for(qtype, blocks if qtype.endswith("K") else 5 * blocks)
    w = padded_weights(rng, qtype, n, k)
    x = rng.standard_normal((m, k)).astype(dtype)
    out = dev(np.full((m, n), np.nan, dtype), target)
    dg.dequant_gemv(dev(x, target), dev(w, target), qtype, out=out, target=target)
    got = host(out).astype(np.float32)
    assert np.isfinite(got).all()
    close(got, dg.dequant_gemv_ref(x, w, qtype), dtype)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_0"])
def test_dequant_gemv_vector_and_small_tiles(qtype, rng):
    """A 1-d x, a batch of 8, and tiles of 2 rows x 1 chunk (a loop step per chunk)."""
    k = k_for(qtype, 2 if qtype == "Q4_K" else 7)
    w = padded_weights(rng, qtype, 3, k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    y = dg.dequant_gemv(x[0], w, qtype)
    assert y.shape == (3,)
    close(y, dg.dequant_gemv_ref(x[:1], w, qtype)[0])
    y = dg.dequant_gemv(x, w, qtype, block_r=2, block_c=1)
    close(y, dg.dequant_gemv_ref(x, w, qtype))
    with pytest.raises(ValueError, match="M <= 8"):
        dg.dequant_gemv(np.zeros((9, k), np.float32), w, qtype)


def test_default_tiles_bound_registers():
    for qtype in dg.QTYPES:
        for m in range(1, 9):
            r, c = dg.default_tiles(qtype, m, 14336)
            assert m * r * c * dg.FORMATS[qtype][1] <= 4096 and c >= 1


@needs_aot
@pytest.mark.parametrize("qtype", dg.QTYPES)
@pytest.mark.parametrize("m", [1, 8])
def test_aot_sm90(qtype, m, tmp_path, monkeypatch):
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry = REGISTRY[f"dequant_gemv_{qtype.lower()}"]
    r, c = dg.default_tiles(qtype, m, 4096)
    x_type = "*fp16" if m > 1 else "*bf16"
    compiled = aot_compile(entry.trace(signature=dict(x=x_type, y=x_type), M=m, BLOCK_R=r, BLOCK_C=c), arch=90)
    assert ".target sm_90a" in compiled.asm["ptx"]


# --- the registry and tools/dump_kernel --------------------------------------------------------------------------

def test_registry_covers_every_kernel():
    from kernels_src import activations, kv_write, paged_attention, paged_prefill, rms_norm, rope

    modules = (activations, kv_write, paged_attention, paged_prefill, rms_norm, rope, dg)
    kernels = {f for mod in modules for name, f in vars(mod).items() if name.endswith("_kernel") and callable(f)}
    assert kernels == {e.fn for e in REGISTRY.values()}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registry_entry(name):
    from kernels_src.dsl.triton_target import TritonRenderer

    e = REGISTRY[name]
    k = e.trace()
    assert k.signature == e.signature and set(k.constexprs) == set(e.constexprs)
    assert f"def {e.fn.__name__}(" in TritonRenderer().render(k)
    assert e.bytes_moved(**e.bench) > 0 and (e.flops is None or e.flops(**e.bench) > 0)


def test_dump_kernel_tool(capsys):
    from tools.dump_kernel import main

    assert main(["paged_decode", "--const", "BLOCK_N=32", "--sig", "q=*fp16"]) == 0
    out = capsys.readouterr().out
    assert "# ---- ir: paged_decode ----" in out and "# ---- triton: paged_decode ----" in out
    assert "BLOCK_N=32" in out and "%q: *fp16" in out and "def paged_decode_kernel(" in out
    assert main(["silu_mul", "--target", "triton", "--const", "ACT=gelu"]) == 0
    assert "tl.erf(" in capsys.readouterr().out
    assert main(["--list"]) == 0 and "dequant_gemv_q6_k" in capsys.readouterr().out
    assert main(["no_such_kernel"]) == 2
    assert main(["rms_norm", "--const", "NOPE=1"]) == 2
