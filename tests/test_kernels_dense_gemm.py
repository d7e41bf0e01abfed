"""The skinny dense GEMM (kernels_src/dense_gemm.py) on random inputs: the DSL interpreter and Triton's interpreter
(fp16; bf16 is not in Triton's interpreter) against x @ W.T in float64 and F.linear, for 9-64 rows, N off the tile,
K of one and several BLOCK_K steps with and without a ragged tail, split-K on and off, both dot orientations,
outputs poisoned first; the SIMT oracle; TUNED and LLM_ENGINE_DENSE_GEMM_TUNED over the rule; the errors; and the
Triton AOT build for sm_90 (wgmma, 16-byte cp.async, no spills, the PDL wait)."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemm import TOL, close, needs_aot
from test_kernels_gemv import _stack_bytes

from kernels_src import dense_gemm as dgm


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _inputs(rng, m, n, k, dtype=np.float16):
    return rng.standard_normal((m, k)).astype(dtype), (rng.standard_normal((n, k)) / k ** 0.5).astype(dtype)


def _run(target, x, w, **kw):
    out = dev(np.full((x.shape[0], w.shape[0]), np.nan, x.dtype), target)
    y = dgm.dense_matmul(dev(x, target), dev(w, target), out=out, target=target, **kw)
    assert y is out
    return host(out)


# (m, n, k, tiles): 9 and 64 rows; N of 70 and 45 (ragged last tile); K of one step (48: one masked 64-wide step),
# several even steps (256 / 64), a ragged tail (200 / 64); split 1, 2 and 3 (3 over 4 steps: the last split
# shorter); swap off; more rows than a tile
CASES = [(9, 70, 48, {}), (64, 45, 256, dict(block_k=64, split_k=2)), (20, 33, 200, dict(block_k=64, split_k=3)),
         (33, 40, 128, dict(block_k=32, swap=False, block_n=16)), (64, 70, 200, dict(block_k=64, split_k=1)),
         (70, 24, 64, dict(block_n=16, block_k=32, split_k=2))]  # 70 rows: two 64-row tiles


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m,n,k,tiles", CASES)
def test_dense_matmul(target, m, n, k, tiles, rng):
    x, w = _inputs(rng, m, n, k)
    close(_run(target, x, w, **tiles), dgm.dense_matmul_ref(x, w), TOL[np.float16])


@pytest.mark.parametrize("target", TARGETS)
def test_strided_rows(target, rng):
    """x and W as column slices of wider matrices (row strides past K), out a slice of a wider y."""
    x, w = _inputs(rng, 12, 30, 96 + 40)
    y = dev(np.full((12, 50), np.nan, np.float16), target)
    got = dgm.dense_matmul(dev(x, target)[:, :96], dev(w, target)[:, :96], out=y[:, 5:35], target=target,
                           block_k=32, split_k=2)
    assert np.isnan(host(y)[:, :5]).all() and np.isnan(host(y)[:, 35:]).all()
    close(host(got), dgm.dense_matmul_ref(x[:, :96], w[:, :96]), TOL[np.float16])


@pytest.mark.skipif(not HAS_TRITON, reason="F.linear needs torch")
def test_against_f_linear(rng):
    """The same product as the runner's cuBLAS path (F.linear on CPU torch), fp16 in and out."""
    import torch
    import torch.nn.functional as F

    x, w = _inputs(rng, 17, 50, 160)
    want = F.linear(torch.from_numpy(x).float(), torch.from_numpy(w).float()).half().numpy()
    got = _run("numpy", x, w, block_k=32, split_k=2)
    close(got, want.astype(np.float64), TOL[np.float16])


def test_simt_cpu(rng):
    """The SIMT lowering (the CPU oracle of the Metal and CUDA C emitters): two row tiles, ragged K, split-K."""
    x, w = _inputs(rng, 18, 19, 80, np.float32)
    close(_run("simt-cpu", x, w, block_m=16, block_n=16, block_k=32, split_k=2), dgm.dense_matmul_ref(x, w),
          TOL[np.float32])


def test_errors(rng):
    x, w = _inputs(rng, 16, 32, 64)
    with pytest.raises(ValueError, match="do not make a GEMM"):
        dgm.dense_matmul(x, w[:, :32])
    with pytest.raises(ValueError, match="one dtype for both"):
        dgm.dense_matmul(x.astype(np.float32), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        dgm.dense_matmul(x, np.asfortranarray(w))
    with pytest.raises(ValueError, match="powers of two of at least 16"):
        dgm.dense_matmul(x, w, block_k=8)
    with pytest.raises(ValueError, match=r"not \[16, 32\]"):
        dgm.dense_matmul(x, w, out=np.zeros((16, 31), np.float16))


def test_tuned_and_env_table(monkeypatch, tmp_path, rng):
    """A TUNED entry replaces the rule for its (row bucket, n, k) only, from MIN_ROWS rows; the file
    LLM_ENGINE_DENSE_GEMM_TUNED names (a sweep's --json) takes precedence, its rows marked `use` only; and the
    launch at the tuned tiles still matches the reference."""
    rule = dgm.default_tiles(20, 45, 256)
    assert rule["BLOCK_M"] == 32 and rule["BLOCK_K"] == 128 and dgm.tuned(20, 45, 256) == {}
    monkeypatch.setitem(dgm.TUNED, (32, 45, 256), dict(block_n=16, block_k=32, split_k=2, swap=False))
    t = dgm.default_tiles(20, 45, 256)
    assert (t["BLOCK_N"], t["BLOCK_K"], t["SPLIT"], t["SWAP"]) == (16, 32, 2, False)
    assert dgm.tuned(8, 45, 256) == {} and dgm.tuned(33, 45, 256) == {}  # under MIN_ROWS; another bucket
    x, w = _inputs(rng, 20, 45, 256)
    close(_run("numpy", x, w), dgm.dense_matmul_ref(x, w), TOL[np.float16])
    path = tmp_path / "t.json"
    rows = [dict(m=32, n=45, k=256, us=1.0, cublas_us=2.0, use=True, tiles=dict(block_n=32, split_k=4)),
            dict(m=64, n=45, k=256, us=3.0, cublas_us=2.0, use=False, tiles=dict(block_n=32))]
    path.write_text(json.dumps(dict(results=rows)))
    monkeypatch.setenv(dgm.TUNED_ENV, str(path))
    dgm._env_tuned.cache_clear()
    try:
        assert dgm.tuned(20, 45, 256) == dict(block_n=32, split_k=4) and dgm.tuned(64, 45, 256) == {}
        path.write_text("[1]")
        dgm._env_tuned.cache_clear()
        with pytest.raises(ValueError, match="not a tools/sweep_dense_gemm --json table"):
            dgm.tuned(20, 45, 256)
    finally:
        monkeypatch.delenv(dgm.TUNED_ENV)
        dgm._env_tuned.cache_clear()


@needs_aot
@pytest.mark.parametrize("m,n,k", [(16, 6144, 4096), (64, 4096, 14336)])
def test_aot_sm90(m, n, k, tmp_path, monkeypatch):
    """The default tiles' sm_90 build: W and x streamed by 16-byte cp.async (no synchronous global load in the loop),
    the dot on wgmma, no spills, the grid-dependency wait; both split K."""
    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dgm, "TUNED", {})  # the rule's tiles (a table entry may take narrower, mma.sync tiles)
    cfg = dgm.default_tiles(m, n, k)
    nw, ns, split = cfg.pop("num_warps"), cfg.pop("num_stages"), cfg.pop("SPLIT")
    kern = dsl_compile(dgm.dense_gemm_kernel, "triton", EVEN_K=True, PDL=True, **cfg)
    sig = dict(w="*bf16", x="*bf16", y="*bf16" if split == 1 else "*fp32")
    c = aot_compile(kern.trace(signature=sig | {p: "i32" for p in kern.runtime_params if p not in sig}), arch=90,
                    num_warps=nw, num_stages=ns, aligned=True)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "griddepcontrol.wait" in ptx
    copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line]
    assert copies and all("0x10" in line for line in copies)
    assert "ld.global" not in ptx
    assert _stack_bytes(c.asm["cubin"], tmp_path) == 0
    assert split > 1  # 96 and 64 tiles of 64 rows of W: fewer than two programs an SM


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not HAS_TRITON, reason="needs torch")
@pytest.mark.parametrize("target", ["numpy", "triton-interpret", "triton"])
@pytest.mark.parametrize("split", [1, 3])
def test_launched_again(target, split, monkeypatch, rng):
    """launched: dense_matmul's result bit for bit, at TUNED's tiles (split-K through its own partials, or straight
    into out), planned once for these shapes; its launch called again after x changes in place (an eager step's kept
    buffer) writes the new x's product into the same out; numpy arrays and a missing out fall back to dense_matmul."""
    import torch

    if target == "triton" and not _cuda():
        pytest.skip("needs a CUDA GPU")
    dev_ = "cuda" if target == "triton" else "cpu"
    monkeypatch.setattr(dgm, "TUNED", {(16, 40, 200): dict(block_n=16, block_k=32, split_k=split)})
    monkeypatch.setattr(dgm, "_PLANS", type(dgm._PLANS)())  # plans are made from TUNED, fixed outside tests
    planned = []
    real_plan = dgm._plan
    monkeypatch.setattr(dgm, "_plan", lambda *a: planned.append(a[0].shape) or real_plan(*a))
    x, w = (torch.from_numpy(a).to(dev_) for a in _inputs(rng, 12, 40, 200))
    out = torch.full((12, 40), float("nan"), dtype=torch.float16, device=dev_)
    y, (launch, args) = dgm.launched(x, w, out=out, target=target)
    assert y is out and planned == [(12, 200)]
    assert torch.equal(out, dgm.dense_matmul(x, w, target=target))
    x.copy_(torch.from_numpy(_inputs(rng, 12, 40, 200)[0]).to(dev_))  # the same tensor, new numbers
    out.fill_(float("nan"))
    launch(*args)
    assert torch.equal(out, dgm.dense_matmul(x, w, target=target))
    close(out.cpu().numpy(), dgm.dense_matmul_ref(x.cpu().numpy(), w.cpu().numpy()), TOL[np.float16])
    other = torch.empty_like(out)
    y2, again = dgm.launched(x, w, out=other, target=target)  # other arrays of the same shapes: the same plan
    assert y2 is other and again is not None and planned == [(12, 200)] and torch.equal(other, out)
    if split > 1:  # another problem's partials: the same scratch
        _, (_, small) = dgm.launched(x[:10], w, out=torch.empty((10, 40), dtype=x.dtype, device=dev_), target=target)
        assert small[1][2].data_ptr() == args[1][2].data_ptr()
    # numpy: dense_matmul itself, nothing to repeat
    assert dgm.launched(x.cpu().numpy(), w.cpu().numpy(), out=None)[1] is None
    with pytest.raises(ValueError, match="one dtype"):
        dgm.launched(x.float(), w, out=torch.empty((12, 40), device=dev_), target=target)
