"""Every DSL kernel by name: its function, the constexprs and a sample signature of a realistic configuration, that
realistic problem (`bench`) and the minimal DRAM bytes it moves, so tools, tests and GPU benchmarks share one list.

`entry.trace()` gives the IR at the default configuration (constexprs overridable); `entry.bytes_moved(**bench)`
(and `flops` where compute matters) turns a measured time into a fraction of peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ir.formats import int_groups
from ir.formats.gguf_quants import row_bytes
from kernels_src import (
    activations,
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
    fp8_gemv,
    gemv_loop,
    gguf_mmq,
    gguf_mmq_sb,
    int_group_gemm,
    int_group_gemm_gather,
    int_group_gemm_stream,
    int_group_gemv,
    int_group_gemv_i8,
    kv_fp8,
    kv_int8,
    kv_write,
    mla_decode,
    moe,
    moe_gemv,
    moe_gguf,
    moe_route,
    paged_attention,
    paged_prefill,
    rms_norm,
    rope,
    rope_kv_write,
)
from kernels_src.dsl import KernelIR, compile
from kernels_src.dsl.tracer import split_params

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class KernelEntry:
    name: str
    fn: Callable  # the DSL kernel
    constexprs: dict  # the configuration `bench` runs with
    pointers: dict[str, str]  # pointer parameters' types there ("*bf16"); other scalars are i32 unless in `floats`
    bench: dict  # a realistic problem, in the launcher's terms
    bytes_moved: Callable[..., int]  # minimal DRAM bytes of a problem: bytes_moved(**bench)
    floats: tuple[str, ...] = ()
    flops: Callable[..., int] | None = None
    launcher: Callable | None = None
    notes: str = ""
    variants: tuple[Callable, ...] = ()  # other DSL kernels the launcher runs instead on some targets (see notes)

    @property
    def signature(self) -> dict[str, str]:
        """A sample runtime signature ({param: "*bf16" | "i32" | "fp32"}), in parameter order."""
        return {p: self.pointers.get(p, "fp32" if p in self.floats else "i32") for p in split_params(self.fn)[0]}

    def kernel(self, target: str = "triton", num_warps: int = 4, **constexprs):
        return compile(self.fn, target, num_warps=num_warps, **(self.constexprs | constexprs))

    def trace(self, signature: dict | None = None, **constexprs) -> KernelIR:
        return self.kernel("numpy", **constexprs).trace(signature=self.signature | (signature or {}))


REGISTRY: dict[str, KernelEntry] = {}


def register(entry: KernelEntry) -> KernelEntry:
    REGISTRY[entry.name] = entry
    return entry


def get(name: str) -> KernelEntry:
    if name not in REGISTRY:
        raise KeyError(f"no kernel {name!r} (known: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def _ptrs(dtype: str, *names: str, **others: str) -> dict[str, str]:
    return {n: "*" + SHORT[dtype] for n in names} | others


# --- elementwise and normalization kernels: T = 4096 tokens of a 4096-wide model -----------------------------------

BF16 = "bfloat16"
_ROWS = dict(rows=4096, hidden=4096, dtype=BF16)

register(KernelEntry(
    "rms_norm", rms_norm.rms_norm_kernel, dict(BLOCK=4096, OFFSET=False, PDL=True), _ptrs(BF16, "x", "w", "out"),
    _ROWS,
    lambda rows, hidden, dtype: (2 * rows * hidden + hidden) * ITEMSIZE[dtype], floats=("eps",),
    launcher=rms_norm.rms_norm))
register(KernelEntry(
    "add_rms_norm", rms_norm.add_rms_norm_kernel, dict(BLOCK=4096, OFFSET=False, PDL=True),
    _ptrs(BF16, "x", "residual", "w", "sum_out", "out"), _ROWS,
    lambda rows, hidden, dtype: (4 * rows * hidden + hidden) * ITEMSIZE[dtype], floats=("eps",),
    launcher=rms_norm.add_rms_norm))
register(KernelEntry(
    "rope", rope.rope_kernel, dict(HALF=64, BLOCK_H=32, BLOCK_R=64, INTERLEAVED=False, PDL=True),
    _ptrs(BF16, "q", "k", positions="*i32", cos="*fp32", sin="*fp32"),
    dict(tokens=4096, q_heads=32, kv_heads=8, head_dim=128, dtype=BF16),
    lambda tokens, q_heads, kv_heads, head_dim, dtype: (
        2 * tokens * (q_heads + kv_heads) * head_dim * ITEMSIZE[dtype] + tokens * (4 + 2 * (head_dim // 2) * 4)),
    launcher=rope.rope, notes="in place on q and k; cos/sin rows read once per token"))
register(KernelEntry(
    "silu_mul", activations.gated_act_kernel, dict(BLOCK=1024, ACT="silu", PDL=True),
    _ptrs(BF16, "gate", "up", "out"),
    dict(tokens=4096, inner=14336, dtype=BF16),
    lambda tokens, inner, dtype: 3 * tokens * inner * ITEMSIZE[dtype], launcher=activations.gated_act))
register(KernelEntry(
    "kv_write", kv_write.kv_write_kernel, dict(BLOCK_H=8, BLOCK_D=128, PDL=True),
    _ptrs(BF16, "k", "v", "k_cache", "v_cache", slots="*i64"), dict(tokens=4096, kv_heads=8, head_dim=128, dtype=BF16),
    lambda tokens, kv_heads, head_dim, dtype: 4 * tokens * kv_heads * head_dim * ITEMSIZE[dtype] + 8 * tokens,
    launcher=kv_write.kv_write, variants=(kv_int8.kv_write_int8_kernel, kv_fp8.kv_write_fp8_kernel),
    notes="variants: kv_int8.kv_write_int8 and kv_fp8.kv_write_fp8 quantize as they write (--kv-cache-dtype int8, "
    "fp8)"))
register(KernelEntry(
    "rope_kv_write", rope_kv_write.rope_kv_write_kernel,
    dict(HALF=64, HEAD_DIM=128, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64, BLOCK_D=128, INTERLEAVED=False, PDL=True),
    _ptrs(BF16, "q", "k", "v", "k_cache", "v_cache", slots="*i64", positions="*i32", cos="*fp32", sin="*fp32"),
    dict(tokens=4096, q_heads=32, kv_heads=8, head_dim=128, dtype=BF16),
    lambda tokens, q_heads, kv_heads, head_dim, dtype: (  # q read and written, k and v read and written to the caches
        (2 * q_heads + 4 * kv_heads) * tokens * head_dim * ITEMSIZE[dtype] + tokens * (4 + 8 + 4 * head_dim)),
    launcher=rope_kv_write.rope_kv_write,
    notes="q rotated in place, k rotated into k_cache, v copied: rope + kv_write in one launch (PDL on triton only)"))

# --- paged attention: decode of 64 sequences of 4096 tokens, 32 query / 8 KV heads of 128, bf16 ----------------

_DECODE = dict(batch=64, context=4096, q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=BF16)
_ATT_PTRS = _ptrs(BF16, "q", "k_cache", "v_cache", "out", block_tables="*i32", context_lens="*i32")


def decode_bytes(batch, context, q_heads, kv_heads, head_dim, block_size, dtype) -> int:
    """K and V of every context once, q and out, the block tables' used entries."""
    kv = 2 * batch * context * kv_heads * head_dim * ITEMSIZE[dtype]
    return kv + 2 * batch * q_heads * head_dim * ITEMSIZE[dtype] + batch * (-(-context // block_size) + 1) * 4


def decode_reduce_bytes(batch, context, q_heads, kv_heads, head_dim, block_size, dtype, partition=512) -> int:
    parts = paged_attention.num_partitions(context, partition)
    return batch * q_heads * (parts * (head_dim + 2) * 4 + head_dim * ITEMSIZE[dtype]) + 4 * batch


register(KernelEntry(
    "paged_decode", paged_attention.paged_decode_kernel,
    dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BS=16, PARTITION=512, SPLIT=True,
         SOFTCAP=False, PDL=True),
    _ATT_PTRS | dict(part_m="*fp32", part_l="*fp32", part_acc="*fp32"), _DECODE, decode_bytes,
    floats=("scale", "softcap"), flops=lambda batch, context, q_heads, head_dim, **_: 4 * batch * context * q_heads
    * head_dim, launcher=paged_attention.paged_decode,
    variants=(paged_attention.paged_decode_int8_kernel, paged_attention.paged_decode_fp8_kernel),
    notes="grid (B, Hkv, partitions); the bench time is this kernel plus paged_decode_reduce; variants: the int8 "
    "cache's (codes and scales, dequantized in registers) and the fp8 cache's (e4m3 decoded, scaled per token)"))
register(KernelEntry(
    "paged_decode_reduce", paged_attention.paged_decode_reduce_kernel,
    dict(HEAD_DIM=128, BLOCK_D=128, PARTITION=512, BLOCK_N=64, BLOCK_P=8, PDL=True),
    dict(part_m="*fp32", part_l="*fp32", part_acc="*fp32", context_lens="*i32", out="*bf16"), _DECODE,
    decode_reduce_bytes, launcher=paged_attention.paged_decode))

# --- MLA decode: 64 sequences of 4096 tokens through a DeepSeek-V3 layer's latent cache (128 heads, 512 + 64) ------

_MLA = dict(batch=64, context=4096, heads=128, rank=512, rope=64, block_size=16, dtype=BF16)


def mla_bytes(batch, context, heads, rank, rope, block_size, dtype) -> int:
    """Each context's latents once (every head group after the first reads them from L2), q and out, the tables."""
    qo = batch * heads * (2 * rank + rope) * ITEMSIZE[dtype]
    return batch * context * (rank + rope) * ITEMSIZE[dtype] + qo + batch * (-(-context // block_size) + 1) * 4


register(KernelEntry(
    "mla_decode", mla_decode.mla_decode_kernel,
    dict(HEADS=128, RANK=512, ROPE=64, BS=16, PARTITION=512, SPLIT=True, PDL=True, **mla_decode.mla_tiles(512, 64)),
    _ptrs(BF16, "q", "cache", "out", block_tables="*i32", context_lens="*i32", part_m="*fp32", part_l="*fp32",
          part_acc="*fp32"), _MLA, mla_bytes, floats=("scale",),
    flops=lambda batch, context, heads, rank, rope, **_: 2 * batch * context * heads * (2 * rank + rope),
    launcher=mla_decode.mla_decode,
    notes="grid (B, heads / BLOCK_H, partitions); the launcher runs paged_decode_reduce (HEAD_DIM = rank) after "
          "it: the bench times both"))

# --- paged prefill: 8 sequences each adding a 512-token chunk to 3584 cached tokens ------------------------------

_PREFILL = dict(seqs=8, query_len=512, context=4096, q_heads=32, kv_heads=8, head_dim=128, block_size=16,
                dtype=BF16)


def prefill_bytes(seqs, query_len, context, q_heads, kv_heads, head_dim, block_size, dtype) -> int:
    qo = 2 * seqs * query_len * q_heads * head_dim * ITEMSIZE[dtype]
    return qo + 2 * seqs * context * kv_heads * head_dim * ITEMSIZE[dtype] + seqs * -(-context // block_size) * 4


def prefill_flops(seqs, query_len, context, q_heads, head_dim, **_) -> int:
    """Two matmuls (2 flops a multiply-add) over the keys each query sees causally."""
    keys = query_len * (context - query_len) + query_len * (query_len + 1) // 2
    return 4 * seqs * keys * q_heads * head_dim


register(KernelEntry(
    "paged_prefill", paged_prefill.paged_prefill_kernel,
    dict(GROUP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_D=128, BLOCK_N=64, BS=16, SOFTCAP=False, PDL=True),
    _ATT_PTRS | dict(query_start="*i32"), _PREFILL, prefill_bytes, floats=("scale", "softcap"),
    flops=prefill_flops, launcher=paged_prefill.paged_prefill,
    variants=(paged_prefill.paged_prefill_int8_kernel, paged_prefill.paged_prefill_fp8_kernel,
              *paged_prefill.MAPPED_KERNELS),
    notes="compute bound: report flops too; variants: the int8 and fp8 caches', and the 16-bit and int8 ones on a "
          "grid of a tile map's capacity (tile_map=, a whole-step CUDA graph's)"))

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
        launcher=dequant_gemm.dequant_matmul, variants=(dequant_gemm.dequant_gemm_reduce_kernel,) + (
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


# --- fused MoE: a decode batch of 16 through a Qwen3-30B-A3B layer's experts (128 of 768 x 2048, top 8) -------------

def _active(tokens, experts, top_k) -> float:
    """The distinct experts a random routing of `tokens` tokens reads, expected."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def moe_bytes(tokens, hidden, inner, experts, top_k, dtype) -> int:
    """The experts a random routing reads, x, and the output."""
    return int(ITEMSIZE[dtype] * (3 * _active(tokens, experts, top_k) * inner * hidden + 2 * tokens * hidden))


def moe_gguf_bytes(tokens, hidden, inner, experts, top_k, qtype, down_qtype, dtype) -> int:
    """The blocks of the experts a random routing reads, x, and the output."""
    per_expert = 2 * inner * row_bytes(qtype, hidden) + hidden * row_bytes(down_qtype, inner)
    return int(_active(tokens, experts, top_k) * per_expert + 2 * tokens * hidden * ITEMSIZE[dtype])


def _moe_flops(tokens, hidden, inner, top_k, **_) -> int:
    return 6 * tokens * top_k * hidden * inner


register(KernelEntry(
    "moe_gemm", moe.moe_gemm_kernel,
    dict(TOP_K=8, GATED=True, ACT="silu", BLOCK_M=moe.BLOCK_M, BLOCK_N=moe.BLOCK_N, BLOCK_K=moe.BLOCK_K, PDL=True),
    _ptrs(BF16, "x", "w_a", "w_b", "y", rows="*i32", block_expert="*i32", weights="*fp32"),
    dict(tokens=16, hidden=2048, inner=768, experts=128, top_k=8, dtype=BF16), moe_bytes,
    flops=_moe_flops, launcher=moe.moe_experts,
    notes="the launcher runs it twice (gate and up with the activation, then down times the routing weights) "
          "after moe_align's array ops, and sums each token's top_k rows"))

# the same layer as Q4_K_M keeps it: gate and up Q4_K, down Q6_K; the gated pass at the launcher's tiles
_block_m, _block_n = moe.default_tiles(16 * 8, 128)
_block_n, _ = moe_gguf.pass_tiles(("Q4_K",), True, _block_m, _block_n)
register(KernelEntry(
    "moe_gemm_gguf", moe_gguf.moe_qgemm_kernel,
    dict(TOP_K=8, GATED=True, ACT="silu", QTYPE_A="Q4_K", QTYPE_B="Q4_K", KB_A=1, KB_B=1, BLOCK_M=_block_m,
         BLOCK_N=_block_n, WIDE=True, PDL=True, WORDS=False),
    _ptrs(BF16, "x", "y", w_a="*u8", w_b="*u8", rows="*i32", block_expert="*i32", weights="*fp32"),
    dict(tokens=16, hidden=2048, inner=768, experts=128, top_k=8, qtype="Q4_K", down_qtype="Q6_K", dtype=BF16),
    moe_gguf_bytes, flops=_moe_flops, launcher=moe.moe_experts,
    notes="moe_gemm's grid and launches over GGUF expert stacks (each weight tile dequantized in registers); the "
          "down pass is this kernel with GATED=False and down_qtype's blocks"))


# the small-batch path: one token (8 slots) through the same layer, a GEMV a slot; dense, then Q4_K_M's formats
_MOE_PTRS = dict(ids="*i32", weights="*fp32")
register(KernelEntry(
    "moe_gemv", moe_gemv.moe_gemv_kernel,
    dict(TOP_K=8, GATED=True, ACT="silu", BLOCK_N=moe_gemv.DENSE_TILES["BLOCK_N"],
         BLOCK_K=moe_gemv.DENSE_TILES["BLOCK_K"], PDL=True),
    _ptrs(BF16, "x", "w_a", "w_b", "y") | _MOE_PTRS,
    dict(tokens=1, hidden=2048, inner=768, experts=128, top_k=8, dtype=BF16), moe_bytes,
    flops=_moe_flops, launcher=moe.moe_experts,
    notes="the launcher's path at up to moe_gemv.GEMV_SLOTS slots: this kernel twice (gate and up with the "
          "activation and routing weight, then down, GATED=False), no grouping; then each token's top_k rows summed"))
_gemv_tiles = moe_gemv._gguf_tiles(moe_gguf.GGUFStack(None, "Q4_K", (128, 768, 2048)),
                                   moe_gguf.GGUFStack(None, "Q4_K", (128, 768, 2048)), True)
_gemv_tiles.pop("num_warps")
register(KernelEntry(
    "moe_gemv_gguf", moe_gemv.moe_qgemv_kernel,
    dict(TOP_K=8, GATED=True, ACT="silu", SUBNORMAL=True, PDL=True, **_gemv_tiles),
    _ptrs(BF16, "x", "y", w_a="*u8", w_b="*u8") | _MOE_PTRS,
    dict(tokens=1, hidden=2048, inner=768, experts=128, top_k=8, qtype="Q4_K", down_qtype="Q6_K", dtype=BF16),
    moe_gguf_bytes, flops=_moe_flops, launcher=moe.moe_experts,
    notes="moe_gemv over GGUF stacks through dequant_gemv's loop (one-warp programs, its tiles at M = 1); the down "
          "pass is this kernel with GATED=False and down_qtype's blocks"))


# DeepSeek-V3's router for a decode batch of 16: 256 experts in 8 groups, sigmoid scores and a correction bias
register(KernelEntry(
    "moe_route", moe_route.moe_route_kernel,
    dict(TOP_K=8, SIGMOID=True, HAS_BIAS=True, NORM=True, N_GROUP=8, TOPK_GROUP=4, TOP2_SUM=True, BLOCK_E=256,
         BLOCK_K=8, BLOCK_G=8, PDL=True),
    _ptrs(BF16, "logits", bias="*fp32", w_out="*fp32", ids_out="*i32"),
    dict(tokens=16, experts=256, top_k=8, dtype=BF16),
    lambda tokens, experts, top_k, dtype: tokens * experts * ITEMSIZE[dtype] + experts * 4 + tokens * top_k * 8,
    floats=("routed_scaling",), launcher=moe_route.moe_route,
    notes="one program a token: scores, the grouped choice and top_k in one tile of the router's logits"))


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
    variants=(dequant_gemm.dequant_gemm_reduce_kernel, int_group_gemm_gather.int_group_gemm_gather_kernel,
              int_group_gemm_stream.int_group_gemm_stream_kernel),
    notes="9-256 rows; split-K writes fp32 partials (y here) that dequant_gemm_reduce_kernel adds into y: the bench "
          "times both; variants gather and stream (x permuted first) by variant=; tools/bench_int_group_gemm times "
          "it against cuBLAS"))

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
