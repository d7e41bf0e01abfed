"""The integer-group GEMV on int8 activations (kernels_src/int_group_gemv_i8.py), on the DSL's interpreter and
Triton's: quantize_x_i8 against its numpy reference (q within 1, the headers' places 0), the dp4a GEMV against what
it computes from that quantized x (gemv_i8_ref, fp64) at the fp32 path's tolerance, and against the exact x @ W.T
within int8_error_bound (which planted bugs exceed); widths 4 and 8, 16- and 8-byte vectors, several steps, bf16 x;
an sm_90 build with dp4a, 16-byte loads, a grid-dependency wait and no spills."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, TARGETS, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot
from test_kernels_int_group import _planted, blocks

from kernels_src import int_group_gemv as ig
from kernels_src import int_group_gemv_i8 as i8


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _check(x, w, bits, group, target, to=dev, **tiles):
    """Run the int8 path; check the quantized x and y both ways."""
    m, k = x.shape
    xt = to(x, target)
    got_q = [host(a) for a in i8.quantize_x_i8(xt, bits, group, target)]
    xf = x if isinstance(x, np.ndarray) else x.float().numpy()
    q, d, sums, rest = i8.quantize_x_i8_ref(xf, bits)
    assert np.abs(i8.unplane(got_q[0], bits, group, k).astype(np.int32) - q).max() <= 1  # a tie may round either way
    for got, want in zip(got_q[1:], (d, sums, rest), strict=True):
        got = i8.unplace(got, bits, group, k)[:, 0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    out = dev(np.full((m, w.shape[0]), np.nan, np.float32), target)
    ig.int_group_gemv(xt, dev(w, target), bits, group, out=out, target=target, int8_x=True, **tiles)
    y = host(out)
    want = i8.gemv_i8_ref(i8.unplane(got_q[0], bits, group, k), d, sums, rest, w, bits, group)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    exact = ig.int_group_gemv_ref(xf, w, bits, group)
    assert (np.abs(y - exact) <= i8.int8_error_bound(xf, w, bits, group) + 1e-5 * np.abs(exact).max()).all()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k,m", [(4, 128, 256, 1), (4, 32, 96, 3), (8, 64, 128, 8), (8, 256, 256, 2)])
def test_int8_gemv(target, bits, group, k, m, rng):
    """16-byte vectors (even group counts) and 8-byte ones (3 groups; one a row)."""
    _check(rng.standard_normal((m, k)).astype(np.float32), blocks(rng, 7, k, bits, group), bits, group, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,k", [(4, 64, 512), (8, 32, 160)])
def test_int8_gemv_over_several_steps(target, bits, group, k, rng):
    _check(rng.standard_normal((2, k)).astype(np.float32), blocks(rng, 5, k, bits, group), bits, group, target,
           lanes=4, rows=2)


@pytest.mark.skipif(not HAS_TRITON, reason="bf16 activations need torch")
@pytest.mark.parametrize("target", TARGETS)
def test_int8_gemv_bf16_x(target, rng):
    import torch

    x = torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32)).bfloat16()
    _check(x, blocks(rng, 6, 256, 4, 128), 4, 128, target, to=lambda a, t: a)


@pytest.mark.parametrize("target", TARGETS)
def test_the_bound_catches_planted_bugs(target, rng):
    """Each planted bug of test_kernels_int_group (nibble order, a neighbour's group, no bias) moves y past
    int8_error_bound: the bound check would catch a kernel with it."""
    k, group = 256, 64
    w = blocks(rng, 5, k, 4, group)
    x = rng.standard_normal((2, k)).astype(np.float32)
    out = dev(np.full((2, 5), np.nan, np.float32), target)
    ig.int_group_gemv(dev(x, target), dev(w, target), 4, group, out=out, target=target, int8_x=True)
    bound = i8.int8_error_bound(x, w, 4, group)
    for bug in ("order", "group", "bias"):
        assert (np.abs(host(out) - x @ _planted(w, 4, group, k, bug).T) > bound).any(), bug


def test_int8_is_the_triton_default():
    assert i8.uses_int8("triton") and not i8.uses_int8("numpy") and not i8.uses_int8("triton", False)


@needs_aot
@pytest.mark.parametrize("bits,m,n", [(4, 1, 14336), (4, 1, 4096), (8, 8, 14336)])
def test_aot_sm90_int8(bits, m, n, tmp_path, monkeypatch):
    """At the launcher's tiles for N with the JIT's 16-byte specialization: dp4a, every row's W and each of x's
    arrays in 16-byte loads (ld.global.v4), headers in 8-byte ones, a grid-dependency wait; no spills."""
    from kernels_src.dsl import compile
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tiles = ig.default_tiles(m, n)
    nw = tiles.pop("num_warps")
    sig = dict(w="*i32", xq="*i8", xd="*fp32", xs="*fp32", xr="*fp32", y="*bf16", n_rows="i32", n_groups="i32",
               w_stride="i32", xq_stride="i32", xd_stride="i32", y_stride="i32")
    k = compile(i8.int_group_gemv_i8_kernel, BITS=bits, GROUP=128, M=m, VEC=4, PDL=True, **tiles).trace(signature=sig)
    compiled = aot_compile(k, arch=90, num_warps=nw, aligned=True)
    ptx = compiled.asm["ptx"]
    assert "dp4a" in ptx and "griddepcontrol.wait" in ptx
    assert ptx.count("ld.global.v4") >= tiles["ROWS"] + m * (2 + i8._planes(bits))
    assert ptx.count("ld.global.b64") >= tiles["ROWS"]
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
