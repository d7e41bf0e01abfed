"""Every registry kernel on a real CUDA GPU: the Triton target (JIT) and the CUDA C target (CuPy, where present)
against the numpy references, at moderate realistic sizes, in fp32 / fp16 / bf16, with poisoned outputs and NaN in
every cache slot outside the contexts (tools/kernel_cases.py builds and checks them). Skipped without a CUDA GPU."""

from __future__ import annotations

import importlib.util
import zlib

import pytest

from kernels_src import dequant_gemv_i8 as dgi
from kernels_src.registry import REGISTRY
from tools.bench_kernels import stream_ctx, target_unavailable
from tools.kernel_cases import build_case, has_case


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

DTYPES = ("float32", "float16", "bfloat16")
# kernel -> [(id, overrides of its registry bench problem)]; the first runs in every dtype, the others in bf16
SIZES = {
    "rms_norm": [("4096", dict(rows=37, hidden=4096)), ("odd", dict(rows=5, hidden=1000))],
    "add_rms_norm": [("4096", dict(rows=37, hidden=4096)), ("odd", dict(rows=5, hidden=1000))],
    "rope": [("llama", dict(tokens=50)), ("odd", dict(tokens=7, q_heads=12, kv_heads=4, head_dim=64))],
    "rope_kv_write": [("llama", dict(tokens=50)), ("odd", dict(tokens=7, q_heads=12, kv_heads=4, head_dim=64,
                                                                block_size=8, rotary_dim=32, interleaved=True))],
    "silu_mul": [("llama", dict(tokens=9)), ("odd", dict(tokens=3, inner=1000))],
    "kv_write": [("padding", dict(tokens=100, padding=True)),
                 ("odd", dict(tokens=7, kv_heads=2, head_dim=64, block_size=8, padding=True))],
    "paged_decode": [("split", dict(batch=6, context=1500, ragged=True)),
                     ("single", dict(batch=3, context=300, ragged=True)),  # one partition: no scratch, no reduce
                     ("gqa8", dict(batch=2, context=700, q_heads=16, kv_heads=2, ragged=True))],
    "paged_decode_reduce": [("split", dict(batch=4, context=1500, ragged=True))],
    "paged_prefill": [("chunked", dict(seqs=4, query_len=100, context=700, ragged=True)),
                      ("gqa8", dict(seqs=2, query_len=40, context=90, q_heads=16, kv_heads=2))],
    # DeepSeek-V3's 128 heads of 512 + 64, split; one partition; heads, rank and rope off their tiles
    "mla_decode": [("v3_split", dict(batch=4, context=1500, ragged=True)),
                   ("single", dict(batch=3, context=300, heads=16, ragged=True)),
                   ("odd", dict(batch=2, context=700, heads=20, rank=96, rope=24, block_size=8, ragged=True))],
}
# all rows of a matrix (r = n, K off the program's tile), and an embedding lookup: random ids into padded rows
SIZES |= {n: [("rows", dict(r=300, n=300, k=4608)), ("lookup", dict(r=77, n=1000, k=2048, padded=True))]
          for n in REGISTRY if n.startswith("dequantize_")}
# the GEMM: the bench's decode batch, a ragged batch on padded rows, the down projection's split-K at 64 rows, a
# prefill-sized 256 rows, and x @ W.T (swap off) over 33 rows
SIZES |= {n: [("m16", dict(m=16, n=300, k=4096)), ("m9_padded", dict(m=9, n=77, k=2048, padded=True)),
              ("m64_split", dict(m=64, n=520, k=14336)), ("m256", dict(m=256, n=200, k=1024)),
              ("m33_noswap", dict(m=33, n=130, k=2048, swap=False))]
          for n in REGISTRY if n.startswith("dequant_gemm_")}
# the dense GEMM: 9 rows (a 16-row tile mostly clamped rows) on a ragged N and K tail, the bench's split-K at 64 rows,
# x @ W.T (swap off) over 33 rows, and a wider batch than the table's buckets
SIZES["dense_gemm"] = [("m9_ragged", dict(m=9, n=77, k=1000)), ("m64_split", dict(m=64, n=520, k=14336)),
                       ("m33_noswap", dict(m=33, n=130, k=2048, swap=False)), ("m128", dict(m=128, n=200, k=1024))]
# decode batches of 1 and 16, and a prefill whose experts take many blocks each
# a decode batch and a prefill's tokens through DeepSeek-V3's router
# integer groups: the bench's token, 8 rows of int8 in groups of 32, and group -1 (a whole 1024-wide row) at 3 rows,
# on int8 x (Triton's default), then the fp32-x path at 1 and 5 rows (odd group count: 8-byte vectors)
SIZES["int_group_gemv"] = [("m1", dict(m=1, n=300, k=4096)), ("m8_i8_g32", dict(m=8, n=77, k=2048, bits=8, group=32)),
                           ("m3_row", dict(m=3, n=130, k=1024, group=1024)),
                           ("m1_fp32x", dict(m=1, n=300, k=4096, int8_x=False)),
                           ("m5_fp32x_odd", dict(m=5, n=77, k=2240, group=64, int8_x=False))]
# the GEMM: the bench's decode batch (split-K), 9 rows of int8 in groups of 32 (four groups a step), group -1 over a
# 1024-wide row, a 64-row down projection, 256 rows on 128-row tiles, x @ W.T (swap off) at 33; variant stream at
# 16 rows (an accumulator a field), 64 (one), on int8 groups of 32 (a scale a word column) and with swap off
SIZES["int_group_gemm"] = [("m16", dict(m=16, n=300, k=4096)), ("m9_i8_g32", dict(m=9, n=77, k=2048, bits=8, group=32)),
                           ("m17_row", dict(m=17, n=130, k=1024, group=1024)),
                           ("m64_down", dict(m=64, n=520, k=14336)), ("m256", dict(m=256, n=200, k=1024, group=64)),
                           ("m33_noswap", dict(m=33, n=130, k=2048, swap=False)),
                           ("m16_stream", dict(m=16, n=300, k=4096, variant="stream")),
                           ("m64_down_stream", dict(m=64, n=520, k=14336, variant="stream")),
                           ("m9_i8_g32_stream", dict(m=9, n=77, k=2048, bits=8, group=32, variant="stream")),
                           ("m33_noswap_stream", dict(m=33, n=130, k=2048, swap=False, variant="stream"))]
# variant mmq (int8 tensor cores): the bench's 16 rows (split-K), 8 bits in groups of 32 at 9 rows (N off the tile),
# one group a row (steps of 128 in it), Llama's down at 64 rows, groups of 64 at 33 rows, 128 rows on 128-row tiles;
# the epilogue's loads a step ahead where the rule leaves them in their step (64 rows) and the other way (16)
SIZES["int_group_mmq"] = [("m16", dict(m=16, n=300, k=4096)), ("m9_i8_g32", dict(m=9, n=77, k=2048, bits=8, group=32)),
                          ("m17_row", dict(m=17, n=130, k=1024, group=1024)),
                          ("m64_down", dict(m=64, n=520, k=14336)), ("m33_g64", dict(m=33, n=130, k=2048, group=64)),
                          ("m128", dict(m=128, n=200, k=1024, bits=8, group=128)),
                          ("m64_prefetch", dict(m=64, n=520, k=4096, prefetch=True)),
                          ("m16_no_prefetch", dict(m=16, n=300, k=4096, prefetch=False))]
SIZES["int_group_dequantize"] = [("g128", dict(n=300, k=4096)), ("i8_g64", dict(n=77, k=1024, bits=8, group=64))]
# FP8: the bench's token, 8 rows in groups of 16 on odd N (two rows a program), one scale a row (K) at 3 rows off
# BLOCK_K (masked steps), 4 rows a program at 5 rows
SIZES["fp8_gemv"] = [("m1", dict(m=1, n=300, k=4096)), ("m8_g16", dict(m=8, n=77, k=2048, group=16)),
                     ("m3_row", dict(m=3, n=130, k=1040, group=1040)), ("m5_rows4", dict(m=5, n=99, k=1024, rows=4))]
# the FP8 GEMM: a 9-row batch on odd N (W's rows clamped; split-K), 64 rows of groups of 64 (a scale each step), the
# bench's prefill shape cut to 512 rows on 64 x 256 tiles, x @ W.T (swap off) over 33 rows, groups of 256 (two steps
# a scale), 300 rows off every tile
SIZES["fp8_gemm"] = [("m9", dict(m=9, n=300, k=4096)), ("m64_g64", dict(m=64, n=520, k=2048, group=64)),
                     ("m512", dict(m=512, n=1024, k=4096)), ("m33_noswap", dict(m=33, n=130, k=2048, swap=False)),
                     ("m16_g256", dict(m=16, n=256, k=1024, group=256)), ("m300_odd", dict(m=300, n=77, k=1024))]
SIZES["moe_route"] = [("t16", dict(tokens=16)), ("t300", dict(tokens=300))]
# the slots grouped by expert: the bench's 64 tokens, 128 of them (the kernel's 1,024-slot bound), tokens on 3 experts
# of 256 (empty ones, long runs), one slot
SIZES["moe_align"] = [("t64", dict(tokens=64)), ("t128_m64", dict(tokens=128, block_m=64)),
                      ("t100_crowd", dict(tokens=100, top_k=2, experts=256, used=3)), ("t1", dict(tokens=1, top_k=1))]
SIZES["moe_gemm"] = [("t16", dict(tokens=16)), ("t1", dict(tokens=1)), ("t300", dict(tokens=300, experts=16))]
# the same over GGUF stacks: Q4_K_M's (Q6_K down), then each format the issue names, a prefill, padded rows
SIZES["moe_gemm_gguf"] = [("t16", dict(tokens=16)),
                          ("t1_q5_k", dict(tokens=1, qtype="Q5_K", down_qtype="Q5_K")),
                          ("t64_q6_k", dict(tokens=64, qtype="Q6_K", down_qtype="Q4_K", padded=True)),
                          ("t300_q8_0", dict(tokens=300, experts=16, qtype="Q8_0", down_qtype="Q8_0")),
                          ("t2048_q4_k", dict(tokens=2048, experts=16, qtype="Q4_K", down_qtype="Q6_K"))]
# the grouped passes on int8 tensor cores (moe_mmq, forced): a decode batch of 16, the bench's 64 on padded rows,
# the formats swapped (Q6_K gate / up), 300 tokens crowding 16 experts (~150 slots, 10 blocks, an expert)
SIZES["moe_mmq"] = [("t16", dict(tokens=16)), ("t64_padded", dict(tokens=64, padded=True)),
                    ("t32_q6_k", dict(tokens=32, qtype="Q6_K", down_qtype="Q4_K")),
                    ("t300_crowd", dict(tokens=300, experts=16))]
# the small-batch GEMV path: one token, GEMV_SLOTS slots (8 of top-8), tokens crowding 8 experts (every expert read
# by 8 slots), DeepSeek-V2-Lite's top-6 of 64 (1408 inner rows: the GGUF gated pass takes 2 a program), N off tiles
SIZES["moe_gemv"] = [("t1", dict(tokens=1)), ("t8", dict(tokens=8)), ("t8_crowd", dict(tokens=8, experts=8)),
                     ("t3_v2_lite", dict(tokens=3, top_k=6, experts=64, inner=1408)),
                     ("t5_odd", dict(tokens=5, top_k=2, experts=8, hidden=1000, inner=300))]
# over GGUF stacks: Q4_K_M's, each format in turn, gate and up of two formats, padded rows, V2-Lite's shape
SIZES["moe_gemv_gguf"] = [("t1", dict(tokens=1)),
                          ("t8_q5_k", dict(tokens=8, qtype="Q5_K", down_qtype="Q5_K")),
                          ("t2_q8_0", dict(tokens=2, qtype="Q8_0", down_qtype="Q8_0", padded=True)),
                          ("t1_q6_k", dict(tokens=1, qtype="Q6_K", down_qtype="Q4_K", padded=True)),
                          ("t4_mixed", dict(tokens=4, qtype="Q8_0", up_qtype="Q4_K", down_qtype="Q6_K")),
                          ("t2_legacy", dict(tokens=2, qtype="Q4_0", up_qtype="Q5_1", down_qtype="Q4_1")),
                          ("t2_small_k", dict(tokens=2, qtype="Q2_K", down_qtype="Q3_K", experts=8)),
                          ("t3_v2_lite", dict(tokens=3, top_k=6, experts=64, inner=1408, qtype="Q4_K",
                                              down_qtype="Q5_0", padded=True))]
# the int8 tensor-core GEMM at the runner's 4-32 rows: a ragged batch, K over several super-blocks, N off the tile
SIZES |= {n: [("m16", dict(m=16, n=300, k=4096)), ("m5", dict(m=5, n=77, k=2048)), ("m32", dict(m=32, n=520, k=1024))]
          for n in REGISTRY if n.startswith("mmq_")}
# the variants' other kernels: per32p's Q4_K (per32's arithmetic), per256 at 64 rows (8 warps, the minimums' MMAs)
SIZES["mmq_q4_k"] += [("m16_per32p", dict(m=16, n=300, k=4096, variant="per32p")),
                      ("m32_per32p", dict(m=32, n=520, k=1024, variant="per32p"))]
SIZES["mmq_sb_q4_k"] += [("m64", dict(m=64, n=300, k=2048))]
# the dense GEMV (each prologue its entry): a decode batch of 1, 3 rows off every tile (N, K odd), 8 rows, the
# residual epilogue at 4, tiles the sweep tries (two rows a program on one warp, K steps of 256), phi-3's down at 8
SIZES |= {n: [("m1", dict(m=1, n=300, k=4096)), ("m3_odd", dict(m=3, n=77, k=1001)), ("m8", dict(m=8, n=130, k=3072)),
              ("m4_residual", dict(m=4, n=200, k=2048, residual=True)),
              ("m2_tiles", dict(m=2, n=99, k=2048, rows=2, block_k=256, num_warps=1)),
              ("m8_phi3", dict(m=8, n=3072, k=8192))]
          for n in REGISTRY if n.startswith("dense_gemv")}
# their SIMT lowerings are checked on the CPU (simt-cpu: tests/test_kernels_gemm.py, tests/test_kernels_moe.py)
TRITON_ONLY = ("dense_gemm", "dequant_gemm_", "moe_gemm", "moe_gemv", "moe_mmq", "mmq_", "int_group_gemm",
               "int_group_mmq", "fp8_gemm")
# CUDA C builds that take NVRTC about a minute each (fully unrolled SIMT code): only the bench's configuration, which
# CuPy's on-disk kernel cache then hands to tools/bench_kernels.py
CUDA_C_SLOW = {"paged_prefill": ("dtype", "q_heads", "kv_heads", "head_dim"),
               "mla_decode": ("dtype", "heads", "rank", "rope")}  # ~166 KB of CUDA C at V3's shape
GEMV = [("m1", dict(m=1, n=300, k=4096), ("bfloat16",)),
        ("m3_padded", dict(m=3, n=77, k=2048, padded=True), ("float16",))]
GEMV_I8 = [("m1_fp32_x", dict(m=1, n=300, k=4096, int8_x=False), ("bfloat16",)),  # the path int8 x replaces
           ("m8_int8_x", dict(m=8, n=130, k=1024, int8_x=True), ("bfloat16",))]


def _cases() -> list:
    out = []
    for name, entry in REGISTRY.items():
        if name.startswith("dequant_gemv_"):
            extra = ("float32",) if entry.bench["qtype"] == "Q4_K" else ()
            variants = [(vid, p, dts + (extra if vid == "m1" else ())) for vid, p, dts in GEMV]
            variants += GEMV_I8 if entry.bench["qtype"] in dgi.I8_QTYPES else []
        else:
            variants = [(vid, p, DTYPES if i == 0 else ("bfloat16",)) for i, (vid, p) in enumerate(SIZES.get(name, []))]
        out += [pytest.param(name, entry.bench | p | {"dtype": dt}, id=f"{name}-{vid}-{dt}")
                for vid, p, dts in variants for dt in dts]
    return out


def test_every_registry_kernel_has_a_gpu_case():
    missing = [n for n in REGISTRY if not has_case(n) or not (n in SIZES or n.startswith("dequant_gemv_"))]
    assert not missing, f"add GPU cases (tools/kernel_cases.py) and sizes here for: {', '.join(missing)}"


@pytest.mark.parametrize("target", ["triton", "cuda"])
@pytest.mark.parametrize("name,params", _cases())
def test_kernel_on_gpu(target, name, params, request):
    reason = target_unavailable(target)
    if reason:
        pytest.skip(reason)
    if target != "triton" and name.startswith(TRITON_ONLY):
        pytest.skip(f"{name} runs on Triton on a GPU (its CUDA C twin is not a target of the runner)")
    keys = CUDA_C_SLOW.get(name, ()) if target == "cuda" else ()
    if any(params[k] != REGISTRY[name].bench[k] for k in keys):
        pytest.skip(f"the CUDA C {name} takes NVRTC about a minute a configuration: only the bench's one is tested")
    import torch

    case = build_case(name, params, seed=zlib.crc32(request.node.name.encode()))
    with stream_ctx(torch, target):
        case.prepare(target)
        try:
            case.launch(target)
        except NotImplementedError as e:  # the SIMT lowering says what it cannot take yet
            pytest.skip(f"{target} cannot lower {name}: {e}")
    torch.cuda.synchronize()
    err, problem = case.check()
    assert problem is None, f"{problem} (worst rel err {err:.2e})"


def test_direct_launch_follows_specialization():
    """Launches through the compiled kernel's C launcher (dsl.launch.DIRECT_LAUNCH) compute what Triton's own
    launcher does, as the arguments move between specializations (an unaligned row view, sizes that are and are not
    multiples of 16) on one Kernel, and each specialization gets its own binary."""
    import torch

    from kernels_src import rms_norm
    from kernels_src.dsl import compile as dsl_compile
    from kernels_src.dsl import launch as dsl_launch

    assert dsl_launch.DIRECT_LAUNCH
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (64, 50, 64, 50):
        base = torch.randn(3, n + 1, device="cuda", generator=gen)
        w = torch.randn(n + 1, device="cuda", generator=gen)
        for x in (base[:, :n], base[:, 1:]):  # aligned rows, then rows 4 bytes off
            for _ in range(2):  # the second launch of a specialization goes through its C launcher
                out = rms_norm.rms_norm(x, w[:n], 1e-5, target="triton")
                want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w[:n]
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    k = dsl_compile(rms_norm.rms_norm_kernel, "triton", launch_pdl=True, BLOCK=64, OFFSET=False, PDL=True)
    assert len(k._direct) >= 3, k._direct.keys()  # (n 64 | 50) x (aligned | not), as Triton specialized them
    # and once compiled, no launch goes through Triton's Python launcher any more
    from triton.runtime.jit import JITFunction

    calls, run = [], JITFunction.run
    JITFunction.run = lambda self, *a, **kw: calls.append(1) or run(self, *a, **kw)
    try:
        rms_norm.rms_norm(base[:, 1:], w[:n], 1e-5, target="triton")
    finally:
        JITFunction.run = run
    assert not calls
