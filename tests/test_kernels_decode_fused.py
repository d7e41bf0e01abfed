"""The split-K decode whose last partition of each (sequence, KV head) combines the partials (kernels_src/
decode_combine.py): against the reference on poisoned caches and outputs (GQA, many partitions in several rounds, a
capped grid, a window with softcap, an empty context, the int8 and fp8 caches), launched twice on the same counters
(back at 0 after each launch), in any order of programs; the two-kernel fallback and where each is chosen; sm_90
builds with their atomic and no spills."""

from __future__ import annotations

import itertools
import os
import re
import zlib

import numpy as np
import pytest
from test_kernels_attention import close, paged_cache
from test_kernels_basic import HAS_TRITON, TARGETS, _sig, dev, host
from test_kernels_kv_fp8 import _fp8_cache
from test_kernels_kv_int8 import _int8_cache

from kernels_src import decode_combine, kv_fp8, kv_int8
from kernels_src import paged_attention as pa
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import interpreter
from kernels_src.registry import REGISTRY


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


CASES = {  # hq, hkv, d, block size, context lens (0: a padded row), partition, block_n, window, softcap, max_parts
    "gqa4_many_parts": (8, 2, 32, 8, [400, 1, 37, 0], 16, 16, None, None, None),  # 25 partitions
    "group3_capped_grid": (6, 2, 24, 8, [300, 20, 129], 16, 16, None, None, 4),  # rows padded to 4; long partitions
    "window_softcap": (4, 1, 16, 32, [50, 9, 300], 16, 16, 20, 30.0, None),  # whole partitions outside the window
}


def want_of(q, kc, vc, tables, ctx, **kw):
    """The reference; an empty context's rows are zeros (the kernels' rule)."""
    live = ctx > 0
    want = np.zeros(q.shape, np.float32)
    want[live] = pa.paged_decode_ref(q[live], kc, vc, tables[live], ctx[live], 0.3, **kw)
    return want


def run_twice(target, q, caches, tables, ctx, hkv, scales=(), **kw):
    """paged_decode's fused form twice on one counters buffer (with one spare entry): outputs, counters after each."""
    counters = dev(np.zeros(len(ctx) * hkv + 1, np.int32), target)
    outs = []
    for _ in range(2):
        out = dev(np.full(q.shape, np.nan, q.dtype), target)
        sc = dict(k_scales=dev(scales[0], target), v_scales=dev(scales[1], target)) if scales else {}
        pa.paged_decode(dev(q, target), *(dev(c, target) for c in caches), dev(tables, target), dev(ctx, target), 0.3,
                        out=out, target=target, fused=True, counters=counters, **sc, **kw)
        outs.append((host(out).astype(np.float32), host(counters).copy()))
    return outs


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode(target, case, rng, monkeypatch):
    hq, hkv, d, bs, lens, partition, block_n, window, cap, max_parts = CASES[case]
    if case == "gqa4_many_parts":  # 8 partitions a round of the combine: 4 rounds
        monkeypatch.setattr(pa, "FUSED_TILE", 4 * 32 * 8)
    kc, vc, tables = paged_cache(rng, lens, hkv, d, bs, np.float32)
    tables[tables < 0] = 0  # an empty context's row reads nothing, but its table entries stay in range
    ctx = np.array(lens, np.int32)
    q = rng.standard_normal((len(ctx), hq, d)).astype(np.float32)
    want = want_of(q, kc, vc, tables, ctx, sliding_window=window, softcap=cap)
    kw = dict(sliding_window=window, softcap=cap, partition=partition, block_n=block_n, max_parts=max_parts,
              max_context=10_000 if max_parts else None)
    for out, counters in run_twice(target, q, (kc, vc), tables, ctx, hkv, **kw):
        close(out, want, np.float32)
        assert not counters.any()


def test_any_program_may_finish_last(rng, monkeypatch):
    """Programs run in a shuffled order (the interpreter's grid walk): whichever partition counts last combines."""
    order = np.random.default_rng(5)

    def shuffled(*ranges):
        pids = list(itertools.product(*ranges))
        return [pids[i] for i in order.permutation(len(pids))]

    monkeypatch.setattr(interpreter, "itertools", type("Shuffled", (), {"product": staticmethod(shuffled)}))
    lens = [170, 33, 64]
    kc, vc, tables = paged_cache(rng, lens, 2, 16, 8, np.float32)
    ctx, q = np.array(lens, np.int32), rng.standard_normal((3, 4, 16)).astype(np.float32)
    for out, counters in run_twice("numpy", q, (kc, vc), tables, ctx, 2, partition=16, block_n=16):
        close(out, want_of(q, kc, vc, tables, ctx), np.float32)
        assert not counters.any()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_fused_decode_quantized_caches(target, kind, rng):
    lens = [1, 137, 70]
    make, deq = (_int8_cache, kv_int8.dequantize_ref) if kind == "int8" else (_fp8_cache, kv_fp8.dequantize_ref)
    (kc, ks, vc, vs), tables = make(rng, lens, 2, 64, 8)
    ctx, q = np.array(lens, np.int32), rng.standard_normal((3, 8, 64)).astype(np.float32)
    want = want_of(q, deq(kc, ks), deq(vc, vs), tables, ctx)
    for out, counters in run_twice(target, q, (kc, vc), tables, ctx, 2, (ks, vs), partition=32, block_n=16):
        np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4)
        assert not counters.any()


def test_where_the_fused_form_runs(monkeypatch):
    assert decode_combine.FUSED_DEFAULT == (os.environ.get("LLM_ENGINE_FUSED_REDUCE", "0") == "1")
    monkeypatch.setattr(decode_combine, "FUSED_DEFAULT", True)  # LLM_ENGINE_FUSED_REDUCE=1
    assert [decode_combine.use_fused_reduce(t) for t in ("triton", "triton-interpret", "numpy", "metal", "cuda")] == \
        [True, True, False, False, False]
    monkeypatch.setattr(decode_combine, "FUSED_DEFAULT", False)  # the default
    assert not decode_combine.use_fused_reduce("triton") and decode_combine.use_fused_reduce("triton", True)
    assert decode_combine.use_fused_reduce("numpy", True)
    with pytest.raises(ValueError, match="no atomics"):
        decode_combine.use_fused_reduce("metal", True)
    e = REGISTRY["paged_decode"]
    for target in ("metal", "cuda", "simt-cpu"):  # the separate reduce kernel runs there
        with pytest.raises(ValueError, match="does not support atomics"):
            dsl_compile(pa.paged_decode_fused_kernel, target, **e.constexprs).source(
                signature=e.signature | {"counters": "*i32"})
    with pytest.raises(ValueError, match="at least"):
        q = np.zeros((2, 4, 16), np.float32)
        kc = np.zeros((4, 8, 2, 16), np.float32)
        pa.paged_decode(q, kc, kc, np.zeros((2, 4), np.int32), np.array([60, 9], np.int32), 0.3, partition=16,
                        block_n=16, fused=True, counters=np.zeros(3, np.int32))


LLAMA = dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BS=16, PARTITION=64, SPLIT=True,
             SOFTCAP=False, BLOCK_P=32, PDL=True)  # batch 1: 64 partitions, 32 a round
PHI3 = LLAMA | dict(GROUP=1, HEAD_DIM=96, BLOCK_P=32)  # batch 1: 32 partitions, one round
ATT = {"q": "*bf16", "out": "*bf16", "block_tables": "*i32", "context_lens": "*i32", "counters": "*i32"} | \
    dict.fromkeys(("part_m", "part_l", "part_acc", "k_scales", "v_scales"), "*fp32")
AOT = {
    "llama_bf16": (pa.paged_decode_fused_kernel, LLAMA, {"k_cache": "*bf16", "v_cache": "*bf16"}),
    "phi3_bf16": (pa.paged_decode_fused_kernel, PHI3, {"k_cache": "*bf16", "v_cache": "*bf16"}),
    "llama_fp8": (pa.paged_decode_fp8_fused_kernel, LLAMA | dict(FP8_CVT=True), {"k_cache": "*u8", "v_cache": "*u8"}),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
@pytest.mark.parametrize("name", list(AOT))
def test_aot_sm90(name, tmp_path, monkeypatch):
    """The batch-1 grids of Llama-3-8B's and phi-3-mini's layers: one acq_rel GPU-scope atomic on one thread, a
    barrier before it, and no spills."""
    from test_kernels_gemv import _stack_bytes

    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn, consts, caches = AOT[name]
    k = dsl_compile(fn, "triton", **consts).trace(signature=_sig(fn, ATT | caches, floats=("scale", "softcap")))
    compiled = aot_compile(k, arch=90, aligned=True)
    lines = [ln.strip() for ln in compiled.asm["ptx"].splitlines()]
    atom = [i for i, ln in enumerate(lines) if re.match(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32", ln)]
    assert len(atom) == 1
    stored = max(i for i, ln in enumerate(lines[:atom[0]]) if "st.global" in ln)  # the partials' last store
    assert any(ln.startswith("bar.sync") for ln in lines[stored:atom[0]])
    assert _stack_bytes(compiled.asm["cubin"], tmp_path) == 0
    # ptxas's release and acquire: a GPU-wide membar before the atomic, the SM's L1 invalidated after it (the
    # combine's plain loads cannot hit lines cached before the other programs wrote)
    sass = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)",
                                                    _cuobjdump(compiled.asm["cubin"], tmp_path, "-sass"))]
    at = next(i for i, ln in enumerate(sass) if "ATOMG.E.ADD" in ln and ".GPU" in ln)
    assert any("MEMBAR" in ln and "GPU" in ln for ln in sass[at - 6:at]) and "CCTL.IVALL" in sass[at + 1]
    # the 16-bit caches' kernels keep 4 programs an SM resident (decode_table.WAVES): 128 registers at most (the
    # two-kernel form's: 96 and 104; the fp8 one's 168, fused ~200)
    regs = int(re.search(r"REG:(\d+)", _cuobjdump(compiled.asm["cubin"], tmp_path, "--dump-resource-usage"))[1])
    assert regs <= 128 or name.endswith("fp8"), regs


def _cuobjdump(cubin: bytes, tmp_path, flag: str) -> str:
    """cuobjdump's `flag` output for a cubin (cuobjdump ships with triton)."""
    import subprocess

    import triton

    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, flag, str(path)], capture_output=True, text=True, check=True).stdout


def _has_cuda() -> bool:
    if not HAS_TRITON:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 32, 96)], ids=["llama3-8b", "phi3-mini"])
def test_gpu_graph_replays(heads):
    """On the GPU, where programs race: a CUDA graph of the fused decode (batch 1's 64-partition grid, and three
    sequences of 1 to 4,000 tokens) replayed 20 times on one counters buffer, against the reference each time."""
    import torch

    hq, hkv, d = heads
    lens = [1, 700, 4000]
    rng = np.random.default_rng(hq + d)
    kc, vc, tables = paged_cache(rng, lens, hkv, d, 16, np.float32)
    tables[tables < 0] = 0
    kc, vc = (np.nan_to_num(c) for c in (kc, vc))
    ctx, q = np.array(lens, np.int32), rng.standard_normal((3, hq, d)).astype(np.float32)
    bf = lambda a: torch.from_numpy(a).to("cuda", torch.bfloat16)  # noqa: E731
    r = lambda a: bf(a).float().cpu().numpy()  # noqa: E731
    want = pa.paged_decode_ref(r(q), r(kc), r(vc), tables, ctx, 0.3)
    dq, dk, dv = bf(q), bf(kc), bf(vc)
    dt, dc = torch.from_numpy(tables).cuda(), torch.from_numpy(ctx).cuda()
    out, counters = torch.empty_like(dq), pa.decode_counters(dq, 3 * hkv)
    ws = pa.decode_workspace(dq, 64)
    run = lambda: pa.paged_decode(dq, dk, dv, dt, dc, 0.3, out=out, max_context=64 * 64, partition=64,  # noqa: E731
                                  max_parts=64, workspace=ws, target="triton", fused=True, counters=counters)
    run()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        np.testing.assert_allclose(out.float().cpu().numpy(), want, rtol=2e-2, atol=2e-2)
    assert not counters.any()
