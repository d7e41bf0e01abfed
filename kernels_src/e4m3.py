"""The e4m3 (OCP FP8 "fn") codec in the kernel DSL: by integer and bit operations, which every target runs, or (decode,
`cvt`) by the DSL's tl.float8e4nv conversion, which Triton lowers on sm_89+ to one cvt.rn.f16x2.e4m3x2 for two bytes
(use_cvt says where kernels take it). The numpy reference is ir/formats/fp8_blocks.encode / decode (checked bit for bit
against torch's float8_e4m3fn in tests/test_isq_quantizers.py).

Byte c: sign bit 7, exponent bits 6-3 of bias 7, mantissa bits 2-0; exponent 0 is subnormal; 0x7F / 0xFF are NaN.
"""

from __future__ import annotations

import functools
import os

from kernels_src.dsl import tl

E4M3_MAX = 448.0  # the largest finite e4m3 value (S.1111.110)
FP16_SHIFT = 256.0  # 2 ** (15 - 7): fp16's exponent bias over e4m3's; decode_f16 gives values times its inverse
MIN_NORMAL = 2.0 ** -6
ROUND_MAGIC = 8388608.0  # 2 ** 23: a float in [0, 8) added to it is rounded to an integer (half to even) by f32's
MAGIC_BITS = 0x4B000000  # add, and that integer sits in the sum's low mantissa bits


# Targets whose kernels decode by the FP8 conversion: Triton's, where the GPU has it (outputs bit-identical to the
# integer path; H200, docs/BENCHMARKS.md 2026-12-04: fp8_gemv 19.8 -> 16.3 us on Llama-3-8B's down projection, the
# fp8 KV cache's decode at 16k 3,266 -> 3,344 tok/s); LLM_ENGINE_FP8_CVT=0 keeps the integer decode.
CVT_TARGETS = () if os.environ.get("LLM_ENGINE_FP8_CVT", "1") == "0" else ("triton",)
# Attention over an fp8 cache decoded by the cvt takes its dots in fp16 where q is bf16: e4m3 -> fp16 is the cvt
# alone, where bf16 costs an F2F an element more (sm_90, Llama's decode at 128 keys a tile: 1,844 -> 1,442 SASS a
# loop step), and fp16 holds every e4m3 value exactly, with 3 more mantissa bits than bf16 for q (saturated at fp16's
# range). The H200 (2026-12-04, docs/BENCHMARKS.md): Llama-3-8B's decode at batch 16 / 16k 287.3 -> 257.9 us, batch 64
# / 16k 1,129 -> 955; LLM_ENGINE_FP8_F16_DOTS=0 keeps q's dtype.
F16_DOTS = os.environ.get("LLM_ENGINE_FP8_F16_DOTS", "1") == "1"
FP16_MAX = 65504.0
# Triton's pipelining depth for the decode over an fp8 cache (0: Triton's default of 3). The e4m3 tiles go through
# shared memory either way, and a token-major V's (its dot runs over tokens, 128+ bytes apart) come back a byte a
# load; without the cp.async stages the sm_90 loop step at 128 keys is 1,015 SASS against 1,442 (1,138 at 2), at 255
# registers against 221. A token-minor V (kv_fp8.V_TOKEN_MINOR, the default) takes the pipelined step to 942.
# Untimed: LLM_ENGINE_FP8_DECODE_STAGES=1|2 for the H200's A/B (tools/bench_decode_attention --budget 0).
DECODE_STAGES = int(os.environ.get("LLM_ENGINE_FP8_DECODE_STAGES", "0") or 0) or None


# Decode over an fp8 cache on FP8 tensor cores (kernels_src/paged_attend_fp8.py): q and the softmax's weights
# quantized to e4m3 too, so the codes go from shared memory into the MMA with no per-element decode (sm_90: wgmma
# ...e4m3.e4m3, 64 keys or dims a warpgroup's rows). It changes the numbers (q kept to ~7 bits in two e4m3 terms, the
# weights rounded to 3 as FlashAttention-3's FP8 path rounds them), so it is off until the H200 times it and checks
# SmolLM2's tokens there: LLM_ENGINE_FP8_MMA=1 (GPU_CHECK_STEPS=pending_fp8_mma).
MMA_TARGETS = ("triton", "triton-interpret", "numpy") if os.environ.get("LLM_ENGINE_FP8_MMA", "0") == "1" else ()


def use_mma(target: str) -> bool:
    """Whether the decode over an fp8 cache built for `target` takes its dots in e4m3 (MMA_TARGETS)."""
    return target in MMA_TARGETS and (target != "triton" or _gpu_converts())


def use_cvt(target: str) -> bool:
    """Whether kernels built for `target` decode e4m3 by the FP8 type's conversion (decode_f16's `cvt`)."""
    return target in CVT_TARGETS and (target != "triton" or _gpu_converts())


@functools.cache
def _gpu_converts() -> bool:
    """False on a GPU below compute capability 8.9, which has no e4m3 conversion (Triton refuses the type there; the
    fp8 KV cache runs on it by integer ops). No GPU: True (sm_90 AOT builds)."""
    import torch

    return not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)


def decode_f16(c, cvt: bool = False):
    """fp16 values of e4m3 byte tiles (any integer dtype holding 0-255) times 2^-8 (cvt: times 1), exactly,
    subnormals included. NaN codes: 480 * 2^-8 (testing for them costs two more ops an element; our encoders write
    them only for NaN inputs, whose scales the KV write makes NaN); NaN by the cvt."""
    if cvt:  # both exact, so results scaled by 1 and by FP16_SHIFT agree bit for bit (power-of-two factors)
        return convert(c, tl.float16)
    # The byte read as int8 and widened copies its sign into bits 8-31; shifted left by 7 its exponent and mantissa
    # sit at fp16's own places (bits 13-7) and the sign at bits 14 and 15: clearing bit 14 leaves the fp16 whose
    # exponent field is e4m3's, i.e. the value over 2^(15 - 7), and fp16's exponent 0 is subnormal too. On sm_90 the
    # byte's extraction sign-extends for free: 1,031 SASS instructions a paged_decode step against 1,263 for
    # (c + (c & 0x80)) << 7.
    s = c.to(tl.uint8).to(tl.int8, bitcast=True).to(tl.int32)
    return ((s << 7) & 0xBF80).to(tl.int16).to(tl.float16, bitcast=True)


def decode_f32(c, cvt: bool = False):
    """fp32 values of e4m3 byte tiles, times 2^-8 unless cvt (see decode_f16)."""
    return convert(c, tl.float32) if cvt else decode_f16(c).to(tl.float32)


def convert(c, dtype):
    """e4m3 values of byte tiles as `dtype` (fp16, bf16 or fp32), exactly, by the FP8 type's conversion (NaN codes
    NaN): straight to bf16 on sm_90 is one F2F an element after the e4m3x2 cvt, not fp16's two-step widening."""
    return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)


def encode(x):
    """e4m3 codes (int32 0-255) of fp32 tiles: round to nearest, ties to even; beyond +-448 saturated to +-448
    (torch's cast gives NaN from 464); NaN to 0x7F with its sign bit, as torch's cast."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), E4M3_MAX)
    u = a.to(tl.int32, bitcast=True)
    # Normal values (from 2^-6) are f32 values with 3 mantissa bits: round the f32 bits to nearest even at bit 20
    # (a carry moves into the exponent, as it should), then rebias the exponent from 127 to 7.
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormals are multiples of 2^-9: a * 512 is exact and below 8, rounded half to even by the magic add
    # (one f32 rounding whether or not the multiply and add contract to an FMA).
    sub = (a * 512.0 + ROUND_MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    code = tl.where(a >= MIN_NORMAL, normal, sub)
    return tl.where(x != x, 0x7F, code) | sign
