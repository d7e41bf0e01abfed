"""Every DSL kernel by name: its function, the constexprs and a sample signature of a realistic configuration, that
realistic problem (`bench`) and the minimal DRAM bytes it moves, so tools, tests and GPU benchmarks share one list.

`entry.trace()` gives the IR at the default configuration (constexprs overridable); `entry.bytes_moved(**bench)`
(and `flops` where compute matters) turns a measured time into a fraction of peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ir.formats.gguf_quants import row_bytes
from kernels_src import (
    activations,
    gguf_mmq_sb,
    kv_fp8,
    kv_int8,
    kv_write,
    mla_decode,
    moe,
    moe_align,
    moe_gemv,
    moe_gguf,
    moe_mmq,
    moe_route,
    paged_attention,
    paged_decode_rope,
    paged_prefill,
    rms_norm,
    rope,
    rope_kv_write,
    x_int8,
    x_int8_groups,
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
    launcher=rms_norm.add_rms_norm, variants=(x_int8.add_rms_norm_q8_kernel, x_int8_groups.add_rms_norm_i8g_kernel,
                                              x_int8_groups.add_rms_norm_mmq_kernel),
    notes="x_int8.add_rms_norm_q8_kernel also writes out's int8 codes and per-32 scales (quantize_x's) for the GGUF "
          "int8 GEMV after it (GROUP=256: quantize_x256's for gguf_mmq's per256), x_int8_groups' "
          "add_rms_norm_i8g_kernel quantize_x_i8's arrays for the integer-group one, add_rms_norm_mmq_kernel "
          "quantize_x_mmq's for its GEMM "
          "(backends/cuda/x_int8_fusion.py)"))
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
    lambda tokens, inner, dtype: 3 * tokens * inner * ITEMSIZE[dtype], launcher=activations.gated_act,
    variants=(x_int8.gated_act_q8_kernel, x_int8_groups.gated_act_i8g_kernel, x_int8_groups.gated_act_mmq_kernel),
    notes="x_int8.gated_act_q8_kernel and x_int8_groups' gated_act_i8g_kernel and gated_act_mmq_kernel also write "
          "out's int8 form (as add_rms_norm's variants)"))
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
    variants=(paged_attention.paged_decode_int8_kernel, paged_attention.paged_decode_fp8_kernel,
              paged_attention.paged_decode_fused_kernel, paged_attention.paged_decode_int8_fused_kernel,
              paged_attention.paged_decode_fp8_fused_kernel, paged_decode_rope.paged_decode_rope_kernel,
              paged_decode_rope.paged_decode_rope_fused_kernel),
    notes="grid (B, Hkv, partitions); the bench time is this kernel plus paged_decode_reduce; variants: the int8 "
    "cache's (codes and scales, dequantized in registers) and the fp8 cache's (e4m3 decoded, scaled per token), "
    "the three *_fused ones that Triton targets run with LLM_ENGINE_FUSED_REDUCE=1 (the last partition combines: no "
    "paged_decode_reduce), and the float cache's two that rotate q and write the step's keys and values themselves "
    "(paged_decode_rope: no rope_kv_write before them)"))
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
          "after moe_align (one launch of moe_align_kernel on Triton), and sums each token's top_k rows"))

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


# the same layer's Q4_K / Q6_K passes on int8 tensor cores (moe_mmq: on unless LLM_ENGINE_MOE_MMQ=0, or
# moe_experts(mmq=True)) at a decode batch of 64 (512 slots, ~4 an expert); the gated pass at the launcher's tiles
register(KernelEntry(
    "moe_mmq", moe_mmq.moe_mmq_kernel,
    dict(TOP_K=8, GATED=True, ACT="silu", QTYPE_A="Q4_K", QTYPE_B="Q4_K", BLOCK_M=moe_mmq.BLOCK_M,
         BLOCK_N=moe_mmq.TILES[False][0], PDL=True, LOOP_STAGES=0),
    _ptrs(BF16, "y", xq="*i8", xd="*fp32", xs="*fp32", w_a="*u8", w_b="*u8", rows="*i32", block_expert="*i32",
          weights="*fp32"),
    dict(tokens=64, hidden=2048, inner=768, experts=128, top_k=8, qtype="Q4_K", down_qtype="Q6_K", dtype=BF16),
    moe_gguf_bytes, flops=_moe_flops, launcher=moe.moe_experts,
    variants=(gguf_mmq_sb.quantize_x256_kernel,),
    notes="each pass runs quantize_x256_kernel on its input (x, then h) first; the down pass is this kernel with "
          "GATED=False and down_qtype's blocks"))


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
                                   moe_gguf.GGUFStack(None, "Q4_K", (128, 768, 2048)), True, slots=8)
_gemv_tiles.pop("num_warps")
register(KernelEntry(
    "moe_gemv_gguf", moe_gemv.moe_qgemv_kernel,
    dict(TOP_K=8, GATED=True, ACT="silu", SUBNORMAL=True, PDL=True, I8=False, **_gemv_tiles),
    _ptrs(BF16, "x", "y", w_a="*u8", w_b="*u8", xd="*fp32") | _MOE_PTRS,
    dict(tokens=1, hidden=2048, inner=768, experts=128, top_k=8, qtype="Q4_K", down_qtype="Q6_K", dtype=BF16),
    moe_gguf_bytes, flops=_moe_flops, launcher=moe.moe_experts,
    notes="moe_gemv over GGUF stacks through dequant_gemv's loop (one-warp programs, its tiles at M = 1); the down "
          "pass is this kernel with GATED=False and down_qtype's blocks; I8 (from moe_gemv.I8_MIN_SLOTS slots): on "
          "int8 x from quantize_x (xd its scales), through dequant_gemv_i8's loads and dots"))


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

# Qwen3-30B-A3B's decode batch of 64 grouped by expert (512 slots over 128 experts) for the grouped passes
_align_tiles = moe_align.tiles(128)
register(KernelEntry(
    "moe_align", moe_align.moe_align_kernel, dict(BLOCK_M=moe.BLOCK_M, **_align_tiles, PDL=True),
    dict(ids="*i32", rows="*i32", block_expert="*i32"),
    dict(tokens=64, experts=128, top_k=8, block_m=moe.BLOCK_M),
    lambda tokens, experts, top_k, block_m, **_: 4 * (tokens * top_k + (block_m + 1) * moe.max_blocks(
        tokens * top_k, experts, block_m)),
    launcher=moe.moe_align,
    notes="one program (moe_align.NUM_WARPS warps) in place of _align's ~30 array ops: latency bound, the ids "
          "read once a pass of expert chunks and again in the quadratic rank pass"))


# The linear kernels' entries live in their own module, which reads this one's KernelEntry and register.
from kernels_src import registry_linear  # noqa: E402, F401
