"""Tiny random FP8 llama checkpoints, packed independently of the engine, with the dense fp32 transformers model of
exactly the dequantized weights as their reference:
- block-wise (quant_method "fp8", DeepSeek-V3 / Qwen3-FP8): e4m3 bytes by torch's float8_e4m3fn on CPU, one
  `weight_scale_inv` per 128x128 block computed here from the format's definition (the block's max |w| / 448);
- compressed-tensors float-quantized (tensor, channel, block): compressed-tensors' own compressor and decompressor.

Hidden 192 and kv rows of 96 leave partial edge blocks of 64 inputs and 96 rows, as real shapes can.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from int_quant_ckpt import LINEARS, write_quantized

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class Case:
    method: str  # "fp8" | "compressed-tensors"
    strategy: str = "block"  # compressed-tensors: "tensor" | "channel" | "block"
    block: tuple[int, int] = (128, 128)
    bf16_scales: bool = False
    hidden: int = 192
    embed: bool = False  # the embedding table in FP8 too (no checkpoint we know does; the backends must not care)


def _block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |w| / 448 of each [bn, bk] block (edge blocks partial): [ceil(N / bn), ceil(K / bk)] f32."""
    (n, k), (bn, bk) = w.shape, block
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w.abs()
    blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    return (blocks.amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12)


def _expand(scales: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    return scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def _blockwise(w: torch.Tensor, case: Case):
    """(stored tensors, dequantized w) of a DeepSeek-V3-style block-wise linear."""
    s = _block_scales(w, case.block)
    full = _expand(s, case.block, w.shape)
    codes = (w / full).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": s}, codes.float() * full


def _ct_scheme(case: Case):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=case.strategy,
                            block_structure=list(case.block) if case.strategy == "block" else None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct(w: torch.Tensor, case: Case):
    """(stored tensors, dequantized w) by compressed-tensors' float-quantized compressor and its decompressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    if case.strategy == "tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(1)
    elif case.strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    else:
        scale = _block_scales(w, case.block)
    if case.bf16_scales:
        scale = scale.to(torch.bfloat16)
    scheme = _ct_scheme(case)
    out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    back = FloatQuantizationCompressor.decompress({"weight": out["weight"], "weight_scale": scale.float()}, scheme)
    return out, back["weight"].float()


def _quant_config(case: Case) -> dict:
    if case.method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(case.block)}
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(config_groups={"group_0": _ct_scheme(case)}, format="float-quantized",
                             quantization_status="compressed", ignore=["lm_head"])
    return json.loads(cfg.model_dump_json())


def write_checkpoint(folder: Path, case: Case, seed: int = 0):
    """The FP8 checkpoint in `folder`; returns the dense transformers model of its dequantized weights."""
    pack = _blockwise if case.method == "fp8" else _ct
    targets = LINEARS + (("model.embed_tokens",) if case.embed else ())
    return write_quantized(folder, case.hidden, seed, lambda _prefix, w: pack(w, case), _quant_config(case), targets)


def dequantized_reference(codes: np.ndarray) -> np.ndarray:
    """fp32 values of e4m3 bytes by torch's float8_e4m3fn (the independent decoder the engine's table is checked by)."""
    return torch.from_numpy(np.ascontiguousarray(codes, np.uint8)).view(torch.float8_e4m3fn).float().numpy()
