"""x's int8 pass fused into add_rms_norm and the gated activation (kernels_src/x_int8, backends/cuda/x_int8_fusion):
the codes exactly and the scales as quantize_x_ref gives them for the kernels' own (rounded) outputs, on the DSL
interpreter (the engine with and without it: test_cuda_kquant_gguf)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_src import activations, rms_norm, x_int8
from kernels_src.dequant_gemv_i8 import quantize_x_ref


@pytest.mark.parametrize("rows,n,offset", [(1, 64, False), (3, 160, True)])
def test_add_rms_norm_q8(rows, n, offset):
    rng = np.random.default_rng(rows * n)
    x, r = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    x[0, :32] = 0.0  # an all-zero block of x + r: code 0, scale 0
    r[0, :32] = 0.0
    w = rng.standard_normal(n).astype(np.float32)
    s, out, xq, xd = x_int8.add_rms_norm_q8(x, r, w, 1e-5, offset=offset)
    s_ref, out_ref = rms_norm.add_rms_norm_ref(x, r, w, 1e-5, offset)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-6)
    q_ref, d_ref = quantize_x_ref(out)  # of the output as written: what quantize_x would read
    np.testing.assert_array_equal(xq, q_ref)
    np.testing.assert_allclose(xd, d_ref, rtol=2e-7, atol=0)
    assert xd[0, 0] == 0 and not xq[0, :32].any()


@pytest.mark.parametrize("rows,n,block", [(2, 96, 32), (1, 256, 1024)])
def test_gated_act_q8(rows, n, block):
    rng = np.random.default_rng(n)
    g, u = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    out, xq, xd = x_int8.gated_act_q8(g, u, "silu", block=block)
    np.testing.assert_allclose(out, activations.gated_act_ref(g, u, "silu"), rtol=1e-5, atol=1e-6)
    q_ref, d_ref = quantize_x_ref(out)
    np.testing.assert_array_equal(xq, q_ref)
    np.testing.assert_allclose(xd, d_ref, rtol=2e-7, atol=0)


def test_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        x_int8.gated_act_q8(np.ones((1, 40), np.float32), np.ones((1, 40), np.float32))
