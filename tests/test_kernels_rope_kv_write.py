"""rope_kv_write (rope + kv_write in one launch) against its numpy reference, exactly: q, k, v as head views of one
fused qkv row, GQA, padding slots; caches start as NaN so a stray or missing write shows. The AOT sm_90 builds are
in test_kernels_basic."""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_basic import TARGETS, dev, host, poisoned

from kernels_src import kv_write, rope
from kernels_src.registry import REGISTRY
from kernels_src.rope_kv_write import rope_kv_write, rope_kv_write_ref

# (tokens, q heads, kv heads, head_dim, rotary_dim, block_size, slot dtype, position dtype)
CASES = {"full_rotary": (5, 4, 1, 16, 16, 4, np.int64, np.int32),
         "partial_rotary": (6, 8, 2, 24, 16, 2, np.int32, np.int64)}


def _problem(rng, case: str, dtype, interleaved: bool = False):
    """Inputs, and the caches' and q's expected values: the reference on copies."""
    t, hq, hk, d, rot, bs, slot_dtype, pos_dtype = CASES[case]
    qkv = rng.standard_normal((t, (hq + 2 * hk) * d)).astype(dtype)  # one fused projection row a token
    angles = np.arange(64)[:, None] * rng.uniform(0.01, 1.0, rot // 2)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = rng.integers(0, 64, t).astype(pos_dtype)
    n_blocks = 2 * -(-t // bs) + 1
    slots = rng.permutation(n_blocks * bs)[:t].astype(slot_dtype)  # spread over the blocks, in no order
    slots[[1, -1]] = -1  # padding: nothing written
    caches = [poisoned((n_blocks, bs, hk, d), dtype) for _ in range(2)]
    want = [c.copy() for c in caches]
    q, k, v = _views(qkv, hq, hk, d)
    want_q = rope_kv_write_ref(q, k, v, *want, slots, positions, cos, sin, interleaved)
    return qkv, caches, slots, positions, cos, sin, want, want_q


def _views(qkv, hq: int, hk: int, d: int):
    """q [T, Hq, D], k and v [T, Hkv, D]: column ranges of qkv [T, (Hq + 2 Hkv) D], strided as backends pass them."""
    heads = qkv.reshape(qkv.shape[0], -1, d)
    return heads[:, :hq], heads[:, hq:hq + hk], heads[:, hq + hk:]


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _run(target, rng, case, dtype, interleaved):
    """Exact agreement: the kernel's fp32 rotation is the reference's, rounded once to the output dtype."""
    hq, hk, d = CASES[case][1:4]
    qkv, caches, slots, positions, cos, sin, want, want_q = _problem(rng, case, dtype, interleaved)
    buf, got = dev(qkv.copy(), target), [dev(c, target) for c in caches]
    rope_kv_write(*_views(buf, hq, hk, d), *got, dev(slots, target), dev(positions, target), dev(cos, target),
                  dev(sin, target), interleaved=interleaved, target=target)
    out = host(buf)
    np.testing.assert_array_equal(_views(out, hq, hk, d)[0], want_q)
    np.testing.assert_array_equal(out[:, hq * d:], qkv[:, hq * d:])  # k and v themselves untouched
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(host(g), w)  # written slots exact; the rest, padding's included, still NaN


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_kv_write(target, dtype, interleaved, case, rng):
    _run(target, rng, case, dtype, interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
def test_simt_cpu(interleaved, rng):
    """The SIMT lowering (the C++ oracle of the CUDA C and Metal emitters) on the partial-rotary case."""
    _run("simt-cpu", rng, "partial_rotary", np.float16, interleaved)


@pytest.mark.parametrize("cache_dtype", [np.float16, np.float32])
def test_matches_rope_then_kv_write(cache_dtype, rng):
    """The specification itself: the unfused pair, run on the same inputs, leaves the same q and caches; with wider
    caches than k too, where rope's rounding to k's dtype shows."""
    hq, hk, d = CASES["partial_rotary"][1:4]
    qkv, caches, slots, positions, cos, sin, *_ = _problem(rng, "partial_rotary", np.float16)
    fused, unfused = qkv.copy(), qkv.copy()
    fc, uc = [c.astype(cache_dtype) for c in caches], [c.astype(cache_dtype) for c in caches]
    rope_kv_write(*_views(fused, hq, hk, d), *fc, slots, positions, cos, sin)
    q, k, v = _views(unfused, hq, hk, d)
    rope.rope(q, k, positions, cos, sin)
    kv_write.kv_write(k, v, *uc, slots)
    np.testing.assert_array_equal(fused[:, :hq * d], unfused[:, :hq * d])
    for f, u in zip(fc, uc, strict=True):
        np.testing.assert_array_equal(f, u)


def test_pdl_waits_before_anything_loads():
    """Positions (and so the table rows), slots, q, k and v may all come from the kernel before."""
    ops = [op.opcode for op in REGISTRY["rope_kv_write"].trace(PDL=True).walk()]
    first_access = min(ops.index(o) for o in ("load", "store"))
    assert ops.index("grid_dep_wait") < first_access and ops.index("grid_dep_launch") < first_access
    plain = [op.opcode for op in REGISTRY["rope_kv_write"].trace(PDL=False).walk()]
    assert "grid_dep_wait" not in plain and "grid_dep_launch" not in plain


def test_shape_errors(rng):
    qkv, (kc, vc), slots, positions, cos, sin, *_ = _problem(rng, "partial_rotary", np.float32)
    q, k, v = _views(qkv, 8, 2, 24)
    bad = {
        "v like k": (q, k, v[:, :1], kc, vc, slots, positions, cos, sin),
        "tokens and head_dim": (q, k[:3], v[:3], kc, vc, slots, positions, cos, sin),
        "contiguous head dims": (q, *(np.zeros((6, 2, 48), np.float32)[:, :, ::2] for _ in "kv"), kc, vc, slots,
                                 positions, cos, sin),
        "do not both hold": (q, k, v, kc[:, :, :1], vc, slots, positions, cos, sin),
        "must be contiguous": (q, k, v, kc[::2], vc[::2], slots, positions, cos, sin),
        "slots": (q, k, v, kc, vc, slots[:2], positions, cos, sin),
        "want equal": (q, k, v, kc, vc, slots, positions, cos, sin[:, :4]),
        "<= 12": (q, k, v, kc, vc, slots, positions, np.ones((64, 13), np.float32), np.ones((64, 13), np.float32)),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            rope_kv_write(*args)
