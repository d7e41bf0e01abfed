"""The registry's matrix-vector and matrix-matrix kernels (kernels_src/registry.py's list, its KernelEntry): the
dequantizing GEMVs and GEMMs over GGUF blocks, the int8 MMQ, the dense GEMV and GEMM, dequantizing rows, and the
integer-group and FP8 weights' kernels; registry.py imports this module last, so REGISTRY holds them."""

from __future__ import annotations

from ir.formats import int_groups
from ir.formats.gguf_quants import row_bytes
from kernels_src import (
    dense_gemm,
    dense_gemv,
    dequant_gemm,
    dequant_gemm_q4k,
    dequant_gemm_stream,
    dequant_gemm_stream_q6k,
    dequant_gemv,
    dequant_gemv_i8,
    dequantize,
    e4m3,
    fp8_gemm,
    fp8_gemv,
    gemv_loop,
    gguf_mmq,
    gguf_mmq_sb,
    int_group_gemm,
    int_group_gemm_gather,
    int_group_gemm_stream,
    int_group_gemv,
    int_group_gemv_i8,
    int_group_mmq,
    split_k,
)
from kernels_src.registry import BF16, ITEMSIZE, KernelEntry, _ptrs, register

# --- dequantizing GEMV: one token through a 14336 x 4096 (up/gate-sized) GGUF matrix -----------------------------


def gemv_bytes(m, n, k, qtype, dtype) -> int:
    return n * row_bytes(qtype, k) + (m * k + m * n) * ITEMSIZE[dtype]


_I8_NOTE = ("on targets in dequant_gemv_i8.I8_TARGETS (triton) the launcher runs quantize_x_kernel (x to int8 per 32) "
            "and dequant_gemv_i8_kernel (dp4a, a programmatic dependent launch) instead: the bench times both")

for _q in dequant_gemv.QTYPES:
    _tiles = dequant_gemv.default_tiles(_q, 1, 14336, 4096)
    _tiles.pop("num_warps")
    _i8 = _q in dequant_gemv_i8.I8_QTYPES
    register(KernelEntry(
        f"dequant_gemv_{_q.lower()}", dequant_gemv.dequant_gemv_kernel,
        dict(QTYPE=_q, M=1, SUBNORMAL=True, PDL=True, PREFETCH=gemv_loop.PREFETCH, STAGES=gemv_loop.STAGES, **_tiles),
        _ptrs(BF16, "x", "y", w="*u8"), dict(m=1, n=14336, k=4096, qtype=_q, dtype=BF16), gemv_bytes,
        flops=lambda m, n, k, **_: 2 * m * n * k, launcher=dequant_gemv.dequant_gemv, notes=_I8_NOTE if _i8 else "",
        variants=(dequant_gemv_i8.quantize_x_kernel, dequant_gemv_i8.dequant_gemv_i8_kernel) if _i8 else ()))

# --- dense GEMV: one token through a bf16 projection, with the op before it as its prologue ------------------------
# Llama-3-8B's and phi-3-mini's projections, each where the runner fuses that prologue: phi-3's o_proj (none), Llama's
# qkv after the first layer's norm, phi-3's gate_up after the residual add + norm, Llama's down after the gated act


def dense_gemv_bytes(m, n, k, prologue, dtype, residual=False) -> int:
    """W once, x (both halves or addends), the norm weight, y, add_rms_norm's sum, the epilogue's residual."""
    e = ITEMSIZE[dtype]
    x = m * k * (2 if prologue in ("add_rms_norm", "gated") else 1) + (k if "norm" in prologue else 0)
    return e * (n * k + x + m * n * (2 if residual else 1) + (m * k if prologue == "add_rms_norm" else 0))


for _p, (_n, _k) in {"none": (3072, 3072), "rms_norm": (6144, 4096), "add_rms_norm": (16384, 3072),
                     "gated": (4096, 14336)}.items():
    _tiles = dense_gemv.default_tiles(_n, _k, 1, _p)
    _tiles.pop("num_warps")
    register(KernelEntry(
        "dense_gemv" + ("" if _p == "none" else f"_{_p}"), dense_gemv.dense_gemv_kernel,
        dict(M=1, PROLOGUE=_p, ACT="silu", OFFSET=False, RESIDUAL=False, EVEN_K=_k % _tiles["BLOCK_K"] == 0, PDL=True,
             **_tiles),
        _ptrs(BF16, "x", "x2", "g", "s_out", "r", "w", "y"), dict(m=1, n=_n, k=_k, prologue=_p, dtype=BF16),
        dense_gemv_bytes, floats=("eps",), flops=lambda m, n, k, **_: 2 * m * n * k, launcher=dense_gemv.dense_gemv,
        notes="x2: add_rms_norm's residual or gated's up; s_out: add_rms_norm's sum (program 0 writes it); r: the "
              "residual epilogue's input"))

# --- dense GEMM: a decode batch of 64 through Llama-3-8B's down projection (split-K's partials and reduce) ---------

_tiles = dense_gemm.default_tiles(64, 4096, 14336)
for _key in ("num_warps", "num_stages", "SPLIT"):
    _tiles.pop(_key)
register(KernelEntry(
    "dense_gemm", dense_gemm.dense_gemm_kernel, dict(EVEN_K=True, PDL=True, **_tiles),
    _ptrs(BF16, "w", "x", y="*fp32"), dict(m=64, n=4096, k=14336, dtype=BF16),
    lambda m, n, k, dtype: ITEMSIZE[dtype] * (n * k + m * k + m * n), flops=lambda m, n, k, **_: 2 * m * n * k,
    launcher=dense_gemm.dense_matmul,
    notes="split-K (default_tiles) writes fp32 partials (y here) that dequant_gemm_reduce_kernel adds into y; "
          "bytes_moved leaves the partials out (they stay in L2)"))

# --- dequantizing rows: a whole 14336 x 4096 GGUF matrix to bf16, as before a GEMM in prefill ----------------------


def dequantize_bytes(r, n, k, qtype, dtype) -> int:
    """r rows of blocks read, r x k written, r row ids."""
    return r * (row_bytes(qtype, k) + k * ITEMSIZE[dtype] + 4)


for _q in dequantize.QTYPES:
    register(KernelEntry(
        f"dequantize_{_q.lower()}", dequantize.dequantize_rows_kernel,
        dict(QTYPE=_q, BLOCKS=dequantize.default_blocks(_q, 4096), WIDE=True, PDL=True),
        dict(w="*u8", rows="*i32", out="*bf16"),
        dict(r=14336, n=14336, k=4096, qtype=_q, dtype=BF16), dequantize_bytes, launcher=dequantize.dequantize_rows,
        notes="rows = arange(n); an embedding lookup is the same kernel on token ids; WIDE=False on SIMT targets"))

# --- dequantizing GEMM: a decode batch of 16 through a 14336 x 4096 (up/gate-sized) GGUF matrix ----------------------

for _q in dequant_gemv.QTYPES:
    _tiles = dequant_gemm.default_tiles(_q, 16, 14336, 4096)
    for _key in ("num_warps", "num_stages", "SPLIT", "CHUNKS"):
        _tiles.pop(_key, None)
    register(KernelEntry(
        f"dequant_gemm_{_q.lower()}", dequant_gemm.dequant_gemm_kernel,
        dict(QTYPE=_q, WIDE=True, WORDS=False, PDL=True, **_tiles), _ptrs(BF16, "x", w="*u8", y="*fp32"),
        dict(m=16, n=14336, k=4096, qtype=_q, dtype=BF16), gemv_bytes, flops=lambda m, n, k, **_: 2 * m * n * k,
        launcher=dequant_gemm.dequant_matmul, variants=(split_k.dequant_gemm_reduce_kernel,) + (
            (dequant_gemm_q4k.dequant_gemm_q4k_kernel, dequant_gemm_stream.dequant_gemm_stream_kernel)
            if _q == "Q4_K" else (dequant_gemm_stream_q6k.dequant_gemm_stream_q6k_kernel,) if _q == "Q6_K" else ()),
        notes="split-K (default_tiles) writes fp32 partials (y here) that dequant_gemm_reduce_kernel adds into y: "
              "the bench times both; bytes_moved leaves the partials out (they stay in L2)"))

# --- int8 tensor-core GEMM (MMQ): the same batch of 16 through Q4_K / Q6_K -----------------------------------------

for _q in gguf_mmq.MMQ_QTYPES:
    _tiles = gguf_mmq.mmq_tiles(_q, 16, 14336, 4096)
    for _key in ("num_warps", "num_stages", "SPLIT", "variant"):
        _tiles.pop(_key)
    register(KernelEntry(
        f"mmq_{_q.lower()}", gguf_mmq.KERNELS[_q], dict(PDL=True, **_tiles),
        dict(w="*u8", xq="*i8", xd="*fp32", xs="*fp32", y="*fp32"),
        dict(m=16, n=14336, k=4096, qtype=_q, dtype=BF16), gemv_bytes, flops=lambda m, n, k, **_: 2 * m * n * k,
        launcher=gguf_mmq.mmq,
        notes="the launcher runs quantize_x_kernel (x to int8 per 32, with block sums) first, and split-K's reduce "
              "(dequant_gemm_reduce_kernel) after"))
    register(KernelEntry(  # the per256 variant: x scaled per super-block, its sub-block MMAs combined in int32
        f"mmq_sb_{_q.lower()}", gguf_mmq_sb.KERNELS[_q], dict(PDL=True, **_tiles),
        dict(w="*u8", xq="*i8", xd="*fp32", xs="*fp32", y="*fp32"),
        dict(m=16, n=14336, k=4096, qtype=_q, dtype=BF16, variant="per256"),
        lambda variant, **p: gemv_bytes(**p), flops=lambda m, n, k, **_: 2 * m * n * k, launcher=gguf_mmq.mmq,
        variants=(gguf_mmq_sb.quantize_x256_kernel, gguf_mmq_sb.mmq_p32_q4k_kernel) if _q == "Q4_K" else (),
        notes="mmq(.., variant='per256'): the launcher runs quantize_x256_kernel (x to int8 per 256, sums per 32) "
              "first, and split-K's reduce after; variant per32p runs mmq_p32_q4k_kernel (mmq_q4_k's arithmetic, "
              "this file's decoding) after quantize_x_kernel"))


# --- integer-group weights (GPTQ / AWQ / compressed-tensors int4, group 128): a token through 14336 x 4096 -----------


def _gemv_tiles(tiles: dict) -> dict:
    return {key: v for key, v in tiles.items() if key != "num_warps"}


def int_group_bytes(n, k, bits, group, dtype, m=0) -> int:
    """W's blocks once, x and y (the dequantization: W's blocks, the dense matrix written)."""
    w = n * k // group * int_groups.block_bytes(bits, group)
    return w + (m * k + m * n if m else n * k) * ITEMSIZE[dtype]


register(KernelEntry(
    "int_group_gemv", int_group_gemv.int_group_gemv_kernel,
    dict(BITS=4, GROUP=128, M=1, VEC=4, SUBNORMAL=True, PDL=True,
         **_gemv_tiles(int_group_gemv.default_tiles(1, 14336))),
    _ptrs(BF16, "x", "y", w="*i32"), dict(m=1, n=14336, k=4096, bits=4, group=128, dtype=BF16), int_group_bytes,
    flops=lambda m, n, k, **_: 2 * m * n * k, launcher=int_group_gemv.int_group_gemv,
    variants=(int_group_gemv_i8.quantize_x_i8_kernel, int_group_gemv_i8.int_group_gemv_i8_kernel),
    notes="1-8 rows, 16-byte vectors of W a lane; int_group_gemm takes more. On int_group_gemv_i8.I8_TARGETS "
          "(triton) the launcher runs quantize_x_i8_kernel and int_group_gemv_i8_kernel (dp4a, a PDL launch) "
          "instead: the bench times both"))
register(KernelEntry(
    "int_group_dequantize", int_group_gemv.int_group_dequantize_kernel, dict(BITS=4, GROUP=128, STEP=2),
    _ptrs(BF16, "out", w="*i32"), dict(n=14336, k=4096, bits=4, group=128, dtype=BF16), int_group_bytes,
    launcher=int_group_gemv.int_group_dequantize, notes="W for a cuBLAS GEMM past int_group_gemm's rows"))

_tiles = int_group_gemm.default_tiles(16, 14336, 4096, 4, 128)
for _key in ("num_warps", "num_stages", "SPLIT"):
    _tiles.pop(_key)
register(KernelEntry(
    "int_group_gemm", int_group_gemm.int_group_gemm_kernel, dict(BITS=4, GROUP=128, PDL=True, **_tiles),
    _ptrs(BF16, "x", w="*i32", y="*fp32"), dict(m=16, n=14336, k=4096, bits=4, group=128, dtype=BF16),
    int_group_bytes, flops=lambda m, n, k, **_: 2 * m * n * k, launcher=int_group_gemm.int_group_matmul,
    variants=(split_k.dequant_gemm_reduce_kernel, int_group_gemm_gather.int_group_gemm_gather_kernel,
              int_group_gemm_stream.int_group_gemm_stream_kernel),
    notes="9-256 rows; split-K writes fp32 partials (y here) that dequant_gemm_reduce_kernel adds into y: the bench "
          "times both; variants gather and stream (x permuted first) by variant=; tools/bench_int_group_gemm times "
          "it against cuBLAS"))

_tiles = int_group_gemm.default_tiles(16, 14336, 4096, 4, 128, variant="mmq")
register(KernelEntry(
    "int_group_mmq", int_group_mmq.int_group_mmq_kernel,
    dict(BITS=4, GROUP=128, STEP=128, BLOCK_M=_tiles["BLOCK_M"], BLOCK_N=_tiles["BLOCK_N"], PREFETCH=True, PDL=True,
         LOOP_STAGES=0),
    dict(w="*i32", xq="*i8", xs="*fp32", y="*fp32"),
    dict(m=16, n=14336, k=4096, bits=4, group=128, dtype=BF16, variant="mmq"),
    lambda variant, **p: int_group_bytes(**p), flops=lambda m, n, k, **_: 2 * m * n * k,
    launcher=int_group_gemm.int_group_matmul, variants=(int_group_mmq.quantize_x_mmq_kernel,),
    notes="int_group_matmul(.., variant='mmq') (LLM_ENGINE_INT_MMQ=1): the launcher runs quantize_x_mmq_kernel (x "
          "to int8 per step) first, and split-K's reduce after"))

_tiles = fp8_gemv.default_tiles(4096, 1)
_tiles.pop("num_warps")
register(KernelEntry(
    "fp8_gemv", fp8_gemv.fp8_gemv_kernel,
    dict(GROUP=128, M=1, EVEN_K=True, PDL=True, PREFETCH=gemv_loop.PREFETCH, STAGES=gemv_loop.STAGES,
         FP8_CVT=e4m3.use_cvt("triton"), **_tiles),
    _ptrs(BF16, "x", "y", codes="*u8", scales="*fp32"), dict(m=1, n=14336, k=4096, group=128, dtype=BF16),
    lambda m, n, k, group, dtype: n * k + n * k // group * 4 + (m * k + m * n) * ITEMSIZE[dtype],
    flops=lambda m, n, k, **_: 2 * m * n * k, launcher=fp8_gemv.fp8_gemv,
    notes="1-8 rows over e4m3 bytes and f32 group scales (backends/cuda/fp8_linear.py's decode path)"))

_tiles = fp8_gemm.default_tiles(2048, 4096, 4096, 128)
for _key in ("num_warps", "num_stages", "SPLIT"):
    _tiles.pop(_key)
register(KernelEntry(
    "fp8_gemm", fp8_gemm.fp8_gemm_kernel, dict(GROUP=128, BK=128, PDL=True, **_tiles),
    _ptrs(BF16, "y", xq="*u8", xs="*fp32", codes="*u8", scales="*fp32"),
    dict(m=2048, n=4096, k=4096, group=128, dtype=BF16),
    lambda m, n, k, group, dtype: n * k + n * k // group * 4 + m * k * ITEMSIZE[dtype] + m * n * ITEMSIZE[dtype],
    flops=lambda m, n, k, **_: 2 * m * n * k, launcher=fp8_gemm.fp8_matmul, variants=(fp8_gemm.fp8_quantize_x_kernel,),
    notes="9+ rows (decode batches, prefill) over e4m3 bytes and f32 group scales: the launcher runs "
          "fp8_quantize_x_kernel (x to e4m3 per row and group) then this (one FP8 dot a step); split-K partials are "
          "added by dequant_gemm_reduce_kernel. The bench times all of them"))
