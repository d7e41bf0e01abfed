"""The basic kernels (rms_norm, rope, gated activations, KV write) on fresh random inputs with poisoned outputs:
the DSL interpreter and Triton's interpreter against the numpy references, and Triton AOT builds for sm_90."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from kernels_src import activations, kv_write, rms_norm, rope, rope_kv_write
from kernels_src.dsl import compile as dsl_compile

HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None
TARGETS = ["numpy", pytest.param("triton-interpret", marks=pytest.mark.skipif(not HAS_TRITON,
                                                                              reason="triton/torch not installed"))]
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float16: dict(rtol=2e-3, atol=2e-3)}


def dev(a: np.ndarray, target: str):
    """The array as the target takes it: numpy for the DSL interpreter, a CPU torch tensor for Triton's."""
    if target == "numpy":
        return a
    import torch

    return torch.from_numpy(a)


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.numpy()


def poisoned(shape, dtype) -> np.ndarray:
    return np.full(shape, np.nan, dtype)


def close(got, want, dtype):
    np.testing.assert_allclose(host(got).astype(np.float32), want.astype(np.float32), **TOL[dtype])


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows,n,offset", [(1, 32, False), (3, 100, True), (4, 257, False)])
def test_rms_norm(target, dtype, rows, n, offset, rng):
    big = rng.standard_normal((rows, n + 7)).astype(dtype)
    x = big[:, :n]  # strided rows
    w = rng.standard_normal(n).astype(dtype)
    out = dev(poisoned((rows, n), dtype), target)
    rms_norm.rms_norm(dev(x, target), dev(w, target), 1e-6, offset=offset, out=out, target=target)
    close(out, rms_norm.rms_norm_ref(x, w, 1e-6, offset), dtype)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_rms_norm_bf16_on_the_interpreter(rng):
    """bf16 through the DSL interpreter (Triton's interpreter mishandles it): torch tensors, rounding exact."""
    import torch

    x = torch.from_numpy(rng.standard_normal((3, 100)).astype(np.float32)).bfloat16()
    w = torch.from_numpy(rng.standard_normal(100).astype(np.float32)).bfloat16()
    out = torch.full((3, 100), float("nan"), dtype=torch.bfloat16)
    rms_norm.rms_norm(x, w, 1e-6, out=out)
    ref = torch.from_numpy(rms_norm.rms_norm_ref(x.float().numpy(), w.float().numpy(), 1e-6)).bfloat16()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("rows,n", [(2, 64), (3, 130)])
def test_add_rms_norm(target, dtype, rows, n, rng):
    x = rng.standard_normal((rows, n)).astype(dtype)
    r = rng.standard_normal((rows, n)).astype(dtype)
    w = rng.standard_normal(n).astype(dtype)
    s_out, out = (dev(poisoned((rows, n), dtype), target) for _ in range(2))
    rms_norm.add_rms_norm(dev(x, target), dev(r, target), dev(w, target), 1e-5, sum_out=s_out, out=out,
                          target=target)
    s_ref, out_ref = rms_norm.add_rms_norm_ref(x, r, w, 1e-5)
    close(s_out, s_ref, dtype)
    close(out, out_ref, dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens,hq,hk,d,rot", [(3, 4, 2, 16, 16), (5, 3, 1, 24, 16)])
def test_rope(target, dtype, interleaved, tokens, hq, hk, d, rot, rng):
    qkv = rng.standard_normal((tokens, hq + 2 * hk, d)).astype(dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]  # views into a fused projection, as the backends hold them
    angles = np.arange(64)[:, None] * rng.uniform(0.01, 1.0, rot // 2)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = rng.integers(0, 64, tokens).astype(np.int64)
    q_ref, k_ref = (rope.rope_ref(t, positions, cos, sin, interleaved) for t in (q, k))
    qkv_dev = dev(qkv, target)
    rope.rope(qkv_dev[:, :hq], qkv_dev[:, hq:hq + hk], dev(positions, target), dev(cos, target), dev(sin, target),
              interleaved=interleaved, target=target)
    got = host(qkv_dev)
    close(got[:, :hq], q_ref, dtype)
    close(got[:, hq:hq + hk], k_ref, dtype)
    np.testing.assert_array_equal(got[:, hq + hk:], qkv[:, hq + hk:])  # v untouched


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("act", activations.ACTIVATIONS)
@pytest.mark.parametrize("tokens,inner,block", [(3, 40, 16), (2, 64, 64)])
def test_gated_act(target, dtype, act, tokens, inner, block, rng):
    gate_up = (2 * rng.standard_normal((tokens, 2 * inner))).astype(dtype)
    out = dev(poisoned((tokens, inner), dtype), target)
    activations.gated_act_fused(dev(gate_up, target), act, out=out, block=block, target=target)
    close(out, activations.gated_act_ref(gate_up[:, :inner], gate_up[:, inner:], act), dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("tokens,heads,d,block_size,slot_dtype", [(6, 2, 8, 4, np.int64), (5, 3, 12, 2, np.int32)])
def test_kv_write(target, dtype, tokens, heads, d, block_size, slot_dtype, rng):
    num_blocks = 5
    k = rng.standard_normal((tokens, heads, d)).astype(dtype)
    v = rng.standard_normal((tokens, heads, d)).astype(dtype)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(slot_dtype)
    slots[1] = -1  # padding: skipped
    k_cache, v_cache = (poisoned((num_blocks, block_size, heads, d), dtype) for _ in range(2))
    k_ref, v_ref = k_cache.copy(), v_cache.copy()
    kv_write.kv_write_ref(k, v, k_ref, v_ref, slots)
    kc, vc = dev(k_cache, target), dev(v_cache, target)
    kv_write.kv_write(dev(k, target), dev(v, target), kc, vc, dev(slots, target), target=target)
    np.testing.assert_array_equal(host(kc), k_ref)  # exact copies; unwritten slots stay NaN
    np.testing.assert_array_equal(host(vc), v_ref)


# --- ahead-of-time builds for sm_90 ----------------------------------------------------------------------------

def _sig(fn, pointers: dict[str, str], floats=("eps",)) -> dict[str, str]:
    params = dsl_compile(fn).runtime_params
    return {p: pointers.get(p, "fp32" if p in floats else "i32") for p in params}


F16 = "*fp16"
_RKV = dict(HALF=64, HEAD_DIM=128, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64, BLOCK_D=128, INTERLEAVED=False, PDL=False)
_RKV_PTRS = {"cos": "*fp32", "sin": "*fp32"}
AOT_CASES = {
    "rms_norm": (rms_norm.rms_norm_kernel, dict(BLOCK=4096, OFFSET=False), {"x": F16, "w": F16, "out": F16}),
    "add_rms_norm": (rms_norm.add_rms_norm_kernel, dict(BLOCK=2048, OFFSET=True),
                     {"x": F16, "residual": F16, "w": F16, "sum_out": F16, "out": F16}),
    "rope_neox": (rope.rope_kernel, dict(HALF=64, BLOCK_H=32, BLOCK_R=64, INTERLEAVED=False),
                  {"q": F16, "k": F16, "positions": "*i64", "cos": "*fp32", "sin": "*fp32"}),
    "rope_interleaved": (rope.rope_kernel, dict(HALF=32, BLOCK_H=8, BLOCK_R=32, INTERLEAVED=True),
                         {"q": "*bf16", "k": "*bf16", "positions": "*i32", "cos": "*fp32", "sin": "*fp32"}),
    "silu_mul": (activations.gated_act_kernel, dict(BLOCK=1024, ACT="silu"), {"gate": F16, "up": F16, "out": F16}),
    "gelu_mul": (activations.gated_act_kernel, dict(BLOCK=1024, ACT="gelu"),
                 {"gate": "*bf16", "up": "*bf16", "out": "*bf16"}),
    "gelu_tanh_mul": (activations.gated_act_kernel, dict(BLOCK=512, ACT="gelu_tanh"),
                      {"gate": "*fp32", "up": "*fp32", "out": "*fp32"}),
    "kv_write": (kv_write.kv_write_kernel, dict(BLOCK_H=8, BLOCK_D=128),
                 {"k": F16, "v": F16, "k_cache": F16, "v_cache": F16, "slots": "*i64"}),
    "rope_kv_write": (rope_kv_write.rope_kv_write_kernel, _RKV, _RKV_PTRS | dict.fromkeys(
        ("q", "k", "v", "k_cache", "v_cache"), F16) | {"slots": "*i64", "positions": "*i32"}),
    "rope_kv_write_pdl": (rope_kv_write.rope_kv_write_kernel,  # partial rotary dims, interleaved pairs
                          _RKV | dict(HALF=32, BLOCK_R=32, INTERLEAVED=True, PDL=True), _RKV_PTRS | dict.fromkeys(
                              ("q", "k", "v", "k_cache", "v_cache"), "*bf16") | {"slots": "*i32", "positions": "*i64"}),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("case", list(AOT_CASES))
def test_aot_sm90(case, tmp_path, monkeypatch):
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real build through ptxas, not a cache hit
    fn, consts, pointers = AOT_CASES[case]
    k = dsl_compile(fn, "triton", **consts).trace(signature=_sig(fn, pointers))
    compiled = aot_compile(k, arch=90)
    assert ".target sm_90a" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 1000
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == bool(consts.get("PDL"))
