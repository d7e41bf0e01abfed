"""FP8 linears read from an HF folder's safetensors into one StoredTensor of the fp8 layout (ir/formats/fp8_blocks.py),
by the folder's `quantization_config`.

What each source stores (facts from DeepSeek-V3's and Qwen3-FP8's files, transformers' FineGrainedFP8 and
compressed-tensors' float-quantized compressor):
- quant_method "fp8" (DeepSeek-V3, Qwen3-FP8): `weight` F8_E4M3 [N, K] and `weight_scale_inv` f32
  [ceil(N / bn), ceil(K / bk)] for `weight_block_size` [bn, bk] (128 x 128); despite its name the scale multiplies:
  w = e4m3 * scale_inv of the block. Edge blocks are partial.
- compressed-tensors `float-quantized`: `weight` F8_E4M3 [N, K] and `weight_scale` (the model's dtype or f32) of one
  value (strategy "tensor"), [N, 1] ("channel") or per block ("block", `block_structure` [bn, bk]); w = e4m3 * scale.
Activations are run unquantized here (a dynamic activation scheme asks nothing stored); static input scales are
refused rather than dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Any

import numpy as np

from ir.formats import fp8_blocks
from ir.formats.errors import ModelFormatError
from ir.formats.int_checkpoints import float_tensor
from ir.weight_formats import fp8_format
from ir.weights import StoredTensor

WHOLE = 0  # a block dimension that spans the whole tensor (per-tensor rows and inputs, per-channel inputs)


@dataclass(frozen=True)
class FP8Scheme:
    """What a folder's quantization_config says about its FP8 linears."""

    method: str  # "fp8" | "compressed-tensors"
    block: tuple[int, int]  # (rows, inputs) one scale covers; WHOLE for a whole dimension
    scale_suffix: str  # "weight_scale_inv" | "weight_scale"


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise ModelFormatError(path, f"unsupported quantization_config: {what}")


def is_fp8(qc: Mapping[str, Any]) -> bool:
    """Whether a quantization_config describes FP8 weights (rather than integer groups)."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    if method != "compressed-tensors":
        return False
    groups = list((qc.get("config_groups") or {}).values())
    fmt = str((groups[0].get("format") if groups else None) or qc.get("format", "")).lower()
    return fmt == "float-quantized"


def scheme_from_config(qc: Mapping[str, Any], path: Path) -> FP8Scheme:
    """The scheme of an FP8 quantization_config, or a ModelFormatError naming what is not supported."""
    if str(qc.get("quant_method")).lower() == "fp8":
        fmt = str(qc.get("fmt", "e4m3")).lower()
        _need(fmt == "e4m3", path, f"FP8 fmt {fmt!r} (supported: e4m3)")
        act = str(qc.get("activation_scheme", "dynamic")).lower()
        _need(act == "dynamic", path, f"activation_scheme {act!r} (supported: dynamic)")
        block = qc.get("weight_block_size") or (128, 128)  # transformers' FineGrainedFP8 default
        _need(len(block) == 2 and all(int(b) > 0 for b in block), path, f"weight_block_size {block}")
        return FP8Scheme("fp8", (int(block[0]), int(block[1])), "weight_scale_inv")
    groups = qc.get("config_groups") or {}
    _need(len(groups) == 1, path, f"{len(groups)} compressed-tensors config groups (supported: one)")
    (group,) = groups.values()
    acts = group.get("input_activations")
    _need(acts is None or bool(acts.get("dynamic")), path, "static input activation scales (supported: none, dynamic)")
    w = group.get("weights") or {}
    _need(str(w.get("type")) == "float" and int(w.get("num_bits", 8)) == 8, path,
          f"{w.get('num_bits')}-bit weights of type {w.get('type')!r} (supported: 8-bit float, e4m3)")
    strategy = str(w.get("strategy", ""))
    if strategy == "block":
        b = w.get("block_structure") or []
        _need(len(b) == 2 and all(int(x) > 0 for x in b), path, f"block_structure {b}")
        block = (int(b[0]), int(b[1]))
    else:
        _need(strategy in ("tensor", "channel"), path, f"strategy {strategy!r} (supported: tensor, channel, block)")
        block = (WHOLE if strategy == "tensor" else 1, WHOLE)
    return FP8Scheme("compressed-tensors", block, "weight_scale")


def read_linear(tensors: Mapping, prefix: str, s: FP8Scheme, path: Path) -> StoredTensor:
    """The linear `prefix` (e.g. model.layers.0.mlp.up_proj) of an FP8 checkpoint as one fp8 tensor."""
    name = f"{prefix}.weight"
    t = tensors[name]
    if t.dtype != "F8_E4M3" or len(t.shape) != 2:
        raise ModelFormatError(path, f"tensor {name!r} is {t.dtype} {list(t.shape)}; FP8 linears are F8_E4M3 "
                               "matrices")
    n, k = (int(d) for d in t.shape)
    scales = float_tensor(tensors, f"{prefix}.{s.scale_suffix}", path)
    bn, bk = (d if b == WHOLE else b for b, d in zip(s.block, (n, k), strict=True))
    want = (-(-n // bn), -(-k // bk))
    if scales.size != want[0] * want[1] or (scales.ndim == 2 and scales.shape != want):
        raise ModelFormatError(path, f"{prefix}.{s.scale_suffix}: {list(scales.shape)} scales for [{n}, {k}] weights "
                               f"in blocks of [{bn}, {bk}]; expected {list(want)}")
    group = gcd(k, bk)  # groups that tile both the row and each source block: a partial edge block included
    if group % 16:
        raise ModelFormatError(path, f"{name}: [{n}, {k}] weights in blocks of {bk} inputs leave groups of {group} "
                               "inputs; supported: multiples of 16")
    blocks, _ = fp8_blocks.pack_block_scales(np.asarray(t.data).reshape(n, k), scales, (bn, bk))
    return StoredTensor(blocks, fp8_format(group).name, (n, k), name)


def linear_prefixes(tensors: Mapping, s: FP8Scheme) -> set[str]:
    """The FP8 linears of a checkpoint: each `<prefix>.weight` with its scale beside it (layers a checkpoint leaves
    unquantized, such as lm_head, have none)."""
    suffix = f".{s.scale_suffix}"
    return {n.removesuffix(suffix) for n in tensors
            if n.endswith(suffix) and f"{n.removesuffix(suffix)}.weight" in tensors}
