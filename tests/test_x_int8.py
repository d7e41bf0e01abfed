"""x's int8 pass fused into add_rms_norm and the gated activation (kernels_src/x_int8, backends/cuda/x_int8_fusion):
the codes and scales exactly as quantize_x_ref and quantize_x (on the same target) give them for the kernels' own
(rounded) outputs, on both interpreters; the sm_90 builds spill nothing (the engine with and without the fusion:
test_cuda_x_int8)."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_basic import TARGETS, _sig, dev, host
from test_kernels_gemv import _stack_bytes, needs_aot

from kernels_src import activations, rms_norm, x_int8, x_int8_groups
from kernels_src.dequant_gemv_i8 import quantize_x, quantize_x_ref
from kernels_src.int_group_gemv_i8 import quantize_x_i8


def _check_codes(out, xq, xd, target):
    """xq, xd against quantize_x_ref of out as written, and against quantize_x run on it on the same target."""
    q_ref, d_ref = quantize_x_ref(host(out))
    np.testing.assert_array_equal(host(xq), q_ref)
    np.testing.assert_allclose(host(xd), d_ref, rtol=2e-7, atol=0)
    q, d = quantize_x(out, target=target)
    np.testing.assert_array_equal(host(xq), host(q))
    np.testing.assert_array_equal(host(xd), host(d))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rows,n,offset", [(1, 64, False), (3, 160, True)])
def test_add_rms_norm_q8(rows, n, offset, target):
    rng = np.random.default_rng(rows * n)
    x, r = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    x[0, :32] = 0.0  # an all-zero block of x + r: code 0, scale 0
    r[0, :32] = 0.0
    w = rng.standard_normal(n).astype(np.float32)
    s, out, xq, xd = x_int8.add_rms_norm_q8(dev(x, target), dev(r, target), dev(w, target), 1e-5, offset=offset,
                                            target=target)
    s_ref, out_ref = rms_norm.add_rms_norm_ref(x, r, w, 1e-5, offset)
    np.testing.assert_array_equal(host(s), s_ref)
    np.testing.assert_allclose(host(out), out_ref, rtol=1e-5, atol=1e-6)
    _check_codes(out, xq, xd, target)
    assert host(xd)[0, 0] == 0 and not host(xq)[0, :32].any()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rows,n,block", [(2, 96, 32), (1, 256, 1024)])
def test_gated_act_q8(rows, n, block, target):
    rng = np.random.default_rng(n)
    g, u = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    out, xq, xd = x_int8.gated_act_q8(dev(g, target), dev(u, target), "silu", block=block, target=target)
    np.testing.assert_allclose(host(out), activations.gated_act_ref(g, u, "silu"), rtol=1e-5, atol=1e-6)
    _check_codes(out, xq, xd, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,group,n,block", [(4, 32, 64, 1024), (4, 128, 384, 128), (8, 64, 192, 64)])
def test_int_group_variants(bits, group, n, block, target):
    """x_int8_groups: quantize_x_i8's four arrays of the output as written, equal to its own on that output (n 384:
    the norm's tile padded to 512; the activation in programs of `block` inputs)."""
    rng = np.random.default_rng(n + bits)
    x, r = (rng.standard_normal((2, n)).astype(np.float32) for _ in range(2))
    x[1, :group] = -r[1, :group]  # a zero group: d 0, codes 0
    w = rng.standard_normal(n).astype(np.float32)
    s, out, arrays = x_int8_groups.add_rms_norm_i8g(dev(x, target), dev(r, target), dev(w, target), 1e-5, bits,
                                                    group, offset=True, target=target)
    np.testing.assert_allclose(host(out), rms_norm.add_rms_norm_ref(x, r, w, 1e-5, True)[1], rtol=1e-5, atol=1e-6)
    out2, arrays2 = x_int8_groups.gated_act_i8g(dev(x, target), dev(r, target), "gelu", bits, group, block=block,
                                                target=target)
    np.testing.assert_allclose(host(out2), activations.gated_act_ref(x, r, "gelu"), rtol=1e-5, atol=1e-6)
    for o, got in ((out, arrays), (out2, arrays2)):
        for a, b in zip(got, quantize_x_i8(o, bits, group, target), strict=True):
            np.testing.assert_array_equal(host(a), host(b))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("rows,n,block", [(1, 256, 1024), (3, 768, 256)])
def test_per256_layout(rows, n, block, split, target):
    """group 256: quantize_x256's q, d per 256 and sums of q per 32 (fp32, or split fp16 pairs) of the output as
    written, equal to its own on that output; n 768: the norm's tile padded to 1024 (a padding group stored
    nowhere), the activation in programs of one group."""
    from kernels_src.gguf_mmq_sb import quantize_x256, quantize_x256_ref

    rng = np.random.default_rng(n + split)
    x, r = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    x[-1, :256] = -r[-1, :256]  # a zero group: d 0, codes 0, sums 0
    x[0, n - 1] += 40.0 * (rows > 1)  # an outlier (not in the zero group): its group's step ~40 / 127
    w = rng.standard_normal(n).astype(np.float32)
    s, out, arrays = x_int8.add_rms_norm_q8(dev(x, target), dev(r, target), dev(w, target), 1e-5, group=256,
                                            split=split, target=target)
    np.testing.assert_allclose(host(out), rms_norm.add_rms_norm_ref(x, r, w, 1e-5, False)[1], rtol=1e-5, atol=1e-6)
    out2, arrays2 = x_int8.gated_act_q8(dev(x, target), dev(r, target), "gelu", block=block, group=256,
                                        split=split, target=target)
    np.testing.assert_allclose(host(out2), activations.gated_act_ref(x, r, "gelu"), rtol=1e-5, atol=1e-6)
    for o, got in ((out, arrays), (out2, arrays2)):
        q_ref, d_ref = quantize_x256_ref(host(o))
        np.testing.assert_array_equal(host(got[0]), q_ref)
        np.testing.assert_allclose(host(got[1]), d_ref, rtol=2e-7, atol=0)
        sums = q_ref.reshape(rows, -1, 32).astype(np.int64).sum(-1)
        xs = host(got[2]).astype(np.float64)
        np.testing.assert_array_equal(xs.reshape(rows, -1, 2).sum(-1) if split else xs, sums)
        for a, b in zip(got, quantize_x256(o, target, split=split), strict=True):
            np.testing.assert_array_equal(host(a), host(b))
    assert not host(arrays[0])[-1, :256].any() and host(arrays[1])[-1, 0] == 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bits,step,rows,n,block", [(4, 128, 3, 384, 128), (8, 32, 2, 96, 1024), (4, 64, 1, 256, 64)])
def test_int_group_mmq_layout(bits, step, rows, n, block, target):
    """x_int8_groups' _mmq kernels: quantize_x_mmq's xq (a step's even inputs first at 4 bits) and D, P, Q per
    (step, row) of the output as written, equal to its own on that output and to quantize_x_mmq_ref (n 384: the
    norm's tile padded to 512)."""
    from kernels_src.int_group_mmq import quantize_x_mmq, quantize_x_mmq_ref

    rng = np.random.default_rng(n + bits)
    x, r = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    x[-1, :step] = -r[-1, :step]  # a zero step: codes 0, D = P = Q = 0
    w = rng.standard_normal(n).astype(np.float32)
    s, out, (xq, xs) = x_int8_groups.add_rms_norm_mmq(dev(x, target), dev(r, target), dev(w, target), 1e-5, bits,
                                                      step, target=target)
    np.testing.assert_allclose(host(out), rms_norm.add_rms_norm_ref(x, r, w, 1e-5, False)[1], rtol=1e-5, atol=1e-6)
    out2, (xq2, xs2) = x_int8_groups.gated_act_mmq(dev(x, target), dev(r, target), "silu", bits, step, block=block,
                                                   target=target)
    np.testing.assert_allclose(host(out2), activations.gated_act_ref(x, r, "silu"), rtol=1e-5, atol=1e-6)
    for o, q, xs_ in ((out, xq, xs), (out2, xq2, xs2)):
        q_ref, xs_ref = quantize_x_mmq_ref(host(o), bits, step)
        np.testing.assert_array_equal(host(q), q_ref)
        np.testing.assert_allclose(host(xs_)[..., :rows], xs_ref, rtol=1e-6, atol=0)
        q_own, xs_own = quantize_x_mmq(o, bits, step, target)
        np.testing.assert_array_equal(host(q), host(q_own))
        np.testing.assert_array_equal(host(xs_)[..., :rows], host(xs_own)[..., :rows])
    assert not host(xq)[-1, :step].any() and not host(xs)[0, :, rows - 1].any()


def test_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        x_int8.gated_act_q8(np.ones((1, 40), np.float32), np.ones((1, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        x_int8.add_rms_norm_q8(*(np.ones((1, 288), np.float32),) * 3, 1e-5, group=256)
    with pytest.raises(ValueError, match="whole groups of 256"):
        x_int8.gated_act_q8(np.ones((1, 512), np.float32), np.ones((1, 512), np.float32), block=384, group=256)
    with pytest.raises(ValueError, match="whole steps of 128"):
        x_int8_groups.gated_act_mmq(np.ones((1, 512), np.float32), np.ones((1, 512), np.float32), "silu", 4, 128,
                                    block=192)
    with pytest.raises(ValueError, match="multiple of the group"):
        x_int8_groups.gated_act_i8g(np.ones((1, 96), np.float32), np.ones((1, 96), np.float32), "silu", 4, 64)


_Q8 = {"xq": "*i8", "xd": "*fp32", "xs": "*fp32"}
_I8G = {"xq": "*i8", "xd": "*fp32", "xs": "*fp32", "xr": "*fp32"}
_MMQ = {"xq": "*i8", "xs": "*fp32"}
AOT = {  # Llama-3-8B's: hidden 4096 (one row a program), the gated activation's 1024-wide tiles of 14336
    "add_rms_norm_q8": (x_int8.add_rms_norm_q8_kernel, dict(BLOCK=4096, OFFSET=False, PDL=True),
                        dict.fromkeys(("x", "residual", "w", "sum_out", "out"), "*bf16") | _Q8),
    "gated_act_q8": (x_int8.gated_act_q8_kernel, dict(BLOCK=1024, ACT="silu", PDL=True),
                     dict.fromkeys(("gate", "up", "out"), "*bf16") | _Q8),
    "add_rms_norm_q256": (x_int8.add_rms_norm_q8_kernel, dict(BLOCK=4096, OFFSET=False, GROUP=256, PDL=True),
                          dict.fromkeys(("x", "residual", "w", "sum_out", "out"), "*bf16") | _Q8),
    "gated_act_q256_split": (x_int8.gated_act_q8_kernel, dict(BLOCK=1024, ACT="silu", GROUP=256, SPLIT=True,
                                                              PDL=True),
                             dict.fromkeys(("gate", "up", "out"), "*bf16") | _Q8 | {"xs": "*fp16"}),
    "add_rms_norm_mmq": (x_int8_groups.add_rms_norm_mmq_kernel,
                         dict(BLOCK=4096, OFFSET=False, BITS=4, STEP=128, PDL=True),
                         dict.fromkeys(("x", "residual", "w", "sum_out", "out"), "*bf16") | _MMQ),
    "gated_act_mmq": (x_int8_groups.gated_act_mmq_kernel, dict(BLOCK=1024, ACT="silu", BITS=4, STEP=128, PDL=True),
                      dict.fromkeys(("gate", "up", "out"), "*bf16") | _MMQ),
    "add_rms_norm_i8g": (x_int8_groups.add_rms_norm_i8g_kernel,  # 4-bit groups of 128 (GPTQ's usual)
                         dict(BLOCK=4096, OFFSET=False, BITS=4, GROUP=128, PDL=True),
                         dict.fromkeys(("x", "residual", "w", "sum_out", "out"), "*bf16") | _I8G),
    "gated_act_i8g": (x_int8_groups.gated_act_i8g_kernel, dict(BLOCK=1024, ACT="silu", BITS=4, GROUP=128, PDL=True),
                      dict.fromkeys(("gate", "up", "out"), "*bf16") | _I8G),
}


@needs_aot
@pytest.mark.parametrize("name", list(AOT))
def test_aot_sm90_q8(name, tmp_path, monkeypatch):
    """sm_90, bf16 x: a grid-dependency wait, nothing spilled (add_rms_norm_q8 64 registers as add_rms_norm,
    gated_act_q8 30 against 28; the _i8g ones 63 and 30, with the barrier before their second pass; Triton 3.7)."""
    from kernels_src.dsl import compile
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn, consts, ptrs = AOT[name]
    compiled = aot_compile(compile(fn, "triton", **consts).trace(signature=_sig(fn, ptrs)), arch=90, aligned=True)
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
    assert "bar.sync" in compiled.asm["ptx"] or not name.endswith("_i8g")  # the second pass waits for the first
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
