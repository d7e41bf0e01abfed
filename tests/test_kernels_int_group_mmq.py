"""int_group_gemm's variant mmq (kernels_src/int_group_mmq.py: x to int8 per step, W's q bytes as int8 MMA operands)
over intgroup blocks, 4 and 8 bits, symmetric (zero point 2**(b - 1)) and asymmetric (RTN's nonzero biases), groups of
32 / 64 / 128 and per-channel. The pre-pass bit for bit against its numpy model; the GEMM against (a) its exact
arithmetic on that quantized x (tight), (b) the dense float64 reference on x itself within mmq_error_bound; M and N
off the tiles, split-K; the DSL interpreter, Triton's (fp16 / fp32 x) and the SIMT lowering. Planted bugs (nibble
order, bias term, group off by one) in the reference fail the tight check. The switch, TUNED, and the sm_90 builds."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from test_kernels_basic import HAS_TRITON, dev, host

from ir.formats import int_groups
from kernels_src import int_group_gemm as igm
from kernels_src import int_group_mmq as mq

TIGHT = 2e-6  # of the largest output: fp32 rounding of the epilogue over the steps, exact integer dots


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def blocks(rng, n: int, k: int, bits: int, group: int, sym: bool) -> np.ndarray:
    """Random valid blocks: fp16 scales, zero points 2**(bits - 1) (sym) or random (asym: biases of both signs)."""
    top = (1 << bits) - 1
    q = rng.integers(0, top + 1, (n, k))
    scales = (rng.uniform(0.5, 1.5, (n, k // group)) / top).astype(np.float16).astype(np.float32)
    zeros = np.full(scales.shape, 1 << (bits - 1)) if sym else rng.integers(0, top + 1, scales.shape)
    return int_groups.pack(q, scales, zeros, bits, group)


def run(x, w, bits, group, target="numpy", **tiles):
    y = igm.int_group_matmul(dev(x, target), dev(w.view(np.int32), target), bits, group, variant="mmq",
                             target=target, **tiles)
    return np.asarray(host(y), np.float64)


def tight_ref(x, w, bits, group):
    return mq.mmq_ref(*mq.quantize_x_mmq_ref(x, bits, mq.mmq_step(bits, group, x.shape[1])), w, bits, group)


def check(got, x, w, bits, group, tol=TIGHT):
    want = tight_ref(np.asarray(x, np.float32), w, bits, group)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
    dense = igm.int_group_matmul_ref(np.asarray(x, np.float32), w, bits, group)
    bound = mq.mmq_error_bound(x, w, bits, group) + 1e-6 * np.abs(dense).max()
    assert (np.abs(got - dense) <= bound).all()
    rest = slice(1, None)  # past the outlier row of test_mmq_numpy (its steps coarser, bounded above)
    assert np.abs(got - dense)[rest].max() < 0.02 * np.abs(dense)[rest].max()  # measured 0.5-0.8%


# (bits, group (0: per-channel), sym, m, n, k, tiles): M and N off the tiles, split-K, every step form, the epilogue's
# loads a step ahead (the rule's choice at these tiles) and in their step
CASES = [(4, 128, False, 20, 70, 512, dict(block_m=16, block_n=64, split_k=2)),
         (4, 64, True, 9, 40, 256, dict(block_m=16, block_n=32, split_k=1, prefetch=False)),
         (4, 0, False, 33, 70, 512, dict(block_m=32, block_n=64, split_k=2)),
         (8, 128, True, 17, 33, 256, dict(block_m=16, block_n=32, split_k=2, prefetch=False)),
         (8, 32, False, 5, 40, 256, dict(block_m=16, block_n=32, split_k=4)),
         (8, 0, False, 40, 33, 256, dict(block_m=64, block_n=32))]


@pytest.mark.parametrize("bits,group,sym,m,n,k,tiles", CASES)
def test_mmq_numpy(bits, group, sym, m, n, k, tiles, rng):
    group = group or k
    w = blocks(rng, n, k, bits, group, sym)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :8] *= 20  # an outlier: its step's inputs coarser, the bound follows
    check(run(x, w, bits, group, **tiles), x, w, bits, group)


@pytest.mark.parametrize("bits,step", [(4, 128), (4, 64), (8, 32)])
def test_pre_pass_bit_for_bit(bits, step, rng):
    """xq (4 bits: each step [even, odd]), D, P, Q as the numpy model has them; an all-zero step gives zeros."""
    x = rng.standard_normal((3, 4 * step)).astype(np.float32)
    x[1, step:2 * step] = 0
    xq, xs = mq.quantize_x_mmq(x, bits, step)
    want_q, want_s = mq.quantize_x_mmq_ref(x, bits, step)
    assert xs.shape == (4, 3, mq.PAD_ROWS)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(xs[:, :, :3], want_s)
    assert (want_s[1, :, 1] == 0).all() and (want_q[1, step:2 * step] == 0).all()
    if bits == 4:  # the permutation: step 0's first half holds x's even inputs
        sx = np.abs(x[0, :step]).max() / 127
        np.testing.assert_allclose(want_q[0, :step // 2] * sx, x[0, :step:2], atol=sx / 2 + 1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
@pytest.mark.parametrize("bits,group,dtype", [(4, 128, "float16"), (8, 64, "float32")])
def test_mmq_triton_interpreter(bits, group, dtype, rng):
    """Triton's interpreter, fp16 and fp32 x (its bf16 is broken): the output's rounding on top of the tight check."""
    import torch

    w = blocks(rng, 70, 256, bits, group, sym=False)
    x = rng.standard_normal((20, 256)).astype(dtype)
    y = igm.int_group_matmul(torch.from_numpy(x), torch.from_numpy(w), bits, group, variant="mmq",
                             target="triton-interpret", block_m=16, block_n=64, split_k=2)
    check(y.double().numpy(), x, w, bits, group, tol=2e-3 if dtype == "float16" else TIGHT)


@pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
def test_mmq_loop_stages_change_no_number(rng):
    """The K loop pipelined (loop_stages, LLM_ENGINE_MMQ_LOOP_STAGES) computes what the plain loop does, bit for
    bit, through Triton's own source (the interpreter), with the epilogue's loads ahead and without."""
    import torch

    w = torch.from_numpy(blocks(rng, 70, 512, 4, 128, sym=False))
    x = torch.from_numpy(rng.standard_normal((20, 512)).astype("float32"))
    for prefetch in (True, False):
        runs = [igm.int_group_matmul(x, w, 4, 128, variant="mmq", target="triton-interpret", block_m=16, block_n=64,
                                     split_k=2, prefetch=prefetch, loop_stages=stages).numpy() for stages in (0, 2)]
        np.testing.assert_array_equal(runs[1], runs[0])
    check(runs[0].astype(np.float64), x.numpy(), w.numpy(), 4, 128, tol=TIGHT)


def test_mmq_simt_cpu(rng):
    """The SIMT lowering (Metal's and CUDA C's) on the CPU oracle: 4 bits, one tile."""
    w = blocks(rng, 64, 256, 4, 128, sym=False)
    x = rng.standard_normal((17, 256)).astype(np.float32)
    check(run(x, w, 4, 128, "simt-cpu", block_m=16, block_n=64, split_k=1), x, w, 4, 128)


def _swap_halves(xq, xs, w, bits, group):  # x's odd inputs against the low nibbles
    s = mq.mmq_step(bits, group, xq.shape[1])
    q = xq.reshape(xq.shape[0], -1, 2, s // 2)[:, :, ::-1].reshape(xq.shape)
    return q, xs, w, bits, group


def _no_bias(xq, xs, w, bits, group):
    xs = xs.copy()
    xs[:, 2] = 0
    return xq, xs, w, bits, group


def _next_group(xq, xs, w, bits, group):  # every step reads its row's next group (the last the first)
    n, bb = w.shape[0], int_groups.block_bytes(bits, group)
    return xq, xs, np.roll(w.reshape(n, -1, bb), -1, axis=1).reshape(n, -1), bits, group


PLANTED = {"nibble order": _swap_halves, "bias term left out": _no_bias, "group off by one": _next_group}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bugs_fail(bug, rng):
    """The tight check tells the kernel from a reference with each bug planted (so the same bug in the kernel fails
    it), far past TIGHT."""
    bits, group = 4, 64
    w = blocks(rng, 40, 256, bits, group, sym=False)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    got = run(x, w, bits, group, block_m=16, block_n=32)
    args = mq.quantize_x_mmq_ref(x, bits, group)
    want = mq.mmq_ref(*args, w, bits, group)
    np.testing.assert_allclose(got, want, rtol=0, atol=TIGHT * np.abs(want).max())
    bad = mq.mmq_ref(*PLANTED[bug](*args, w, bits, group))
    assert np.abs(got - bad).max() > 1e3 * TIGHT * np.abs(want).max()


def test_where_it_applies():
    """A step of min(G, 128) inputs, a power of two dividing G and K, each dot >= 32 deep; else None (the caller
    keeps stream / blocked), and the launcher says why."""
    assert mq.mmq_step(4, 128, 4096) == 128 and mq.mmq_step(4, 64, 4096) == 64 and mq.mmq_step(4, 4096, 4096) == 128
    assert mq.mmq_step(8, 32, 4096) == 32 and mq.mmq_step(4, 32, 4096) is None  # nibble halves of 16
    assert mq.mmq_step(4, 96, 4032) is None and mq.mmq_step(4, 192, 4032) is None  # 96: no power of two
    assert mq.mmq_step(4, 4160, 4160) is None  # per-channel K not a multiple of 128
    w = np.zeros((32, 128 // 32 * int_groups.block_bytes(4, 32)), np.uint8)
    with pytest.raises(ValueError, match="mmq takes 4-bit groups of 32"):
        igm.int_group_matmul(np.zeros((16, 128), np.float32), w, 4, 32, variant="mmq")
    with pytest.raises(ValueError, match="swap=True"):
        igm.int_group_matmul(np.zeros((16, 128), np.float32), w, 4, 32, variant="mmq", swap=False)


def test_the_switch_and_tuned(monkeypatch):
    """LLM_ENGINE_INT_MMQ=1: mmq wherever it fits, over TUNED's variant, at MMQ_TILES (a stream entry's tiles are
    not mmq's); unset, a TUNED entry naming mmq picks it with its tiles; =0, that entry is skipped."""
    assert igm.MMQ == {"1": True, "0": False}.get(os.environ.get("LLM_ENGINE_INT_MMQ", ""))
    key = (4, 128, 64, 4096, 4096)
    stream = dict(variant="stream", block_m=64, block_n=64, swap=True, num_warps=4, num_stages=3, split_k=4, accs=1)
    monkeypatch.setattr(igm, "TUNED", {key: stream})
    monkeypatch.setattr(igm, "MMQ", False)
    assert igm.tuned_variant(64, 4096, 4096, 4, 128) == "stream"
    monkeypatch.setattr(igm, "MMQ", True)
    assert igm.tuned_variant(64, 4096, 4096, 4, 128) == "mmq"
    assert igm.tuned_variant(64, 4096, 4096, 4, 32) == "stream"  # 4-bit groups of 32: not mmq's
    cfg = igm.default_tiles(64, 4096, 4096, 4, 128, variant="mmq")
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]) == tuple(
        igm.MMQ_TILES[64][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps"))
    mine = dict(variant="mmq", block_m=32, block_n=128, swap=True, num_warps=8, num_stages=4, split_k=2)
    monkeypatch.setattr(igm, "TUNED", {key: mine})
    monkeypatch.setattr(igm, "MMQ", None)  # the default: TUNED decides
    assert igm.tuned_variant(64, 4096, 4096, 4, 128) == "mmq"
    monkeypatch.setattr(igm, "MMQ", False)  # LLM_ENGINE_INT_MMQ=0: TUNED's mmq entry skipped
    assert igm.tuned_variant(64, 4096, 4096, 4, 128) == "stream"
    cfg = igm.default_tiles(64, 4096, 4096, 4, 128, variant="mmq")
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], cfg["SPLIT"]) == (32, 128, 8, 4, 2)


def test_tuned_mmq_runs(monkeypatch, rng):
    """int_group_matmul with no variant given follows a TUNED mmq entry (its tiles) to the same numbers."""
    w = blocks(rng, 40, 256, 8, 64, sym=True)
    x = rng.standard_normal((12, 256)).astype(np.float32)
    monkeypatch.setattr(igm, "TUNED", {(8, 64, 16, 40, 256): dict(variant="mmq", block_m=16, block_n=32, swap=True,
                                                                   num_warps=4, num_stages=3, split_k=2)})
    check(np.asarray(igm.int_group_matmul(x, w, 8, 64), np.float64), x, w, 8, 64)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="AOT builds need triton, and TRITON_INTERPRET unset")
@pytest.mark.parametrize("rows,loop_stages", [(16, 0), (64, 0), (128, 0), (64, 3)])
def test_aot_sm90(rows, loop_stages, tmp_path, monkeypatch, capsys):
    """MMQ_TILES' builds for an H200 (4 bits, groups of 128, arguments 16-byte aligned as the JIT specializes; the
    epilogue's loads ahead by the launcher's rule): int8 MMAs, no I2F in the loop, nothing spilled; prints registers
    and the loop's mix a step."""
    from kernels_src.dsl.triton_target import aot_compile
    from kernels_src.registry import REGISTRY
    from tools.sass_mix import loop_mix

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    t = igm.MMQ_TILES[rows]
    kir = REGISTRY["int_group_mmq"].trace(BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
                                          PREFETCH=mq.prefetch_for(t["BLOCK_M"], t["BLOCK_N"], t["num_warps"]),
                                          LOOP_STAGES=loop_stages)
    c = aot_compile(kir, arch=90, num_warps=t["num_warps"], num_stages=t["num_stages"], aligned=True)
    mix = loop_mix(c.asm["cubin"])
    with capsys.disabled():
        print(f"\nint_group_mmq {rows} rows {t}: {mix.summary()}")
    assert mix.stack == 0 and mix.opcodes["IGMMA"] and not mix.opcodes["I2F"] and not mix.opcodes["LDL"]
    if loop_stages:  # the K loop pipelined: W's q bytes by cp.async too, no global load waited for in the loop
        assert mix.opcodes["LDG"] == 0 < mix.opcodes["LDGSTS"]
