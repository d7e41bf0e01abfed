"""A quantized HF folder's linears by its `quantization_config`: integer groups (GPTQ, AWQ, compressed-tensors
pack-quantized: ir/formats/int_checkpoints.py) or FP8 (quant_method "fp8", compressed-tensors float-quantized:
ir/formats/fp8_checkpoints.py). The loader asks only this module which reader a folder needs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ir.formats import fp8_checkpoints, int_checkpoints
from ir.weights import StoredTensor

Scheme = int_checkpoints.IntScheme | fp8_checkpoints.FP8Scheme


def scheme_from_config(qc: Mapping[str, Any], path: Path) -> Scheme:
    """The scheme of a config.json's quantization_config, or a ModelFormatError naming what is not supported."""
    if fp8_checkpoints.is_fp8(qc):
        return fp8_checkpoints.scheme_from_config(qc, path)
    return int_checkpoints.scheme_from_config(qc, path)


def _reader(s: Scheme):
    return fp8_checkpoints if isinstance(s, fp8_checkpoints.FP8Scheme) else int_checkpoints


def linear_prefixes(tensors: Mapping, s: Scheme) -> set[str]:
    """The quantized linears of a checkpoint (`<prefix>.weight` for the architectures' load_weights)."""
    return _reader(s).linear_prefixes(tensors, s)


def read_linear(tensors: Mapping, prefix: str, s: Scheme, path: Path) -> StoredTensor:
    """The linear `prefix` as one StoredTensor of its family's layout."""
    return _reader(s).read_linear(tensors, prefix, s, path)
