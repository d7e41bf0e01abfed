"""Every weight format the loader hands out, in one table: what each is (a family: dense floats, GGUF blocks, integer
groups from GPTQ, AWQ and compressed-tensors checkpoints, FP8 e4m3 with block scales), how it lies in memory
(blocks of `block_elems` values in `block_bytes` along the last dimension, never across rows), its logical and stored
shapes, and how it decodes to fp32. This is the only place formats are told apart: a backend asks a tensor's format
for its family and keeps the tensor in a form its kernels take, or dequantizes it."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ir.formats import fp8_blocks, gguf_quants, int_groups

__all__ = ["FORMATS", "WeightFormat", "fp8_format", "int_group_format", "weight_format"]


@dataclass(frozen=True)
class WeightFormat:
    name: str  # a StoredTensor's kind: "F32", "F16", "BF16", "Q4_K", ...
    family: str  # "dense" | "gguf" | "intgroup" | "fp8"
    block_elems: int  # values per block along the last dimension (1 for dense)
    block_bytes: int  # bytes per block

    @property
    def quantized(self) -> bool:
        return self.family != "dense"

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of n values (n a whole number of blocks)."""
        if n % self.block_elems:
            raise ValueError(f"{self.name}: a row of {n} values is not a whole number of {self.block_elems}-value "
                             "blocks")
        return n // self.block_elems * self.block_bytes

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The bytes of a tensor of logical `shape` (any rank: a 3-D expert stack too) as [rows, row bytes]."""
        return (prod(shape[:-1]), self.row_bytes(shape[-1]))

    @property
    def element_dtype(self) -> np.dtype:
        """A dense format's stored element: what its raw bytes are a view of (bf16 as uint16 bits, as the readers
        hand bf16 out)."""
        if self.quantized:
            raise ValueError(f"{self.name} is stored in blocks, not elements")
        return np.dtype(_ELEMENTS[self.name])

    def dequantize(self, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """fp32 values of logical `shape` from the stored data (typed dense arrays, bf16 bits or raw blocks)."""
        if self.family == "intgroup":
            return int_groups.dequantize(data, shape, *int_groups.parse_kind(self.name))
        if self.family == "fp8":
            return fp8_blocks.dequantize(data, shape, self.block_elems)
        return gguf_quants.dequantize(np.ascontiguousarray(data), self.name, shape)

    @property
    def int_group(self) -> tuple[int, int]:
        """(bits, group size) of an intgroup format (layout: ir/formats/int_groups.py)."""
        spec = int_groups.parse_kind(self.name) if self.family == "intgroup" else None
        if spec is None:
            raise ValueError(f"{self.name} is not an integer-group format")
        return spec


_ELEMENTS = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def _family(name: str) -> str:
    return "dense" if name in ("F32", "F16", "BF16") else "gguf"


FORMATS: dict[str, WeightFormat] = {
    s.name: WeightFormat(s.name, _family(s.name), s.block_size, s.type_size) for s in gguf_quants.QTYPES.values()}


def int_group_format(bits: int, group: int) -> WeightFormat:
    """The intgroup format of `bits`-wide values in groups of `group` inputs (GPTQ, AWQ, compressed-tensors), entered
    in FORMATS on first use: its group size is a checkpoint's (a whole row for GPTQ's group -1)."""
    name = int_groups.kind_name(bits, group)
    if name not in FORMATS:
        int_groups.check(bits, group)
        FORMATS[name] = WeightFormat(name, "intgroup", group, int_groups.block_bytes(bits, group))
    return FORMATS[name]


def fp8_format(group: int) -> WeightFormat:
    """The fp8 format of e4m3 values with one scale per `group` inputs of a row (ir/formats/fp8_blocks.py), entered
    in FORMATS on first use."""
    name = fp8_blocks.kind_name(group)
    if name not in FORMATS:
        fp8_blocks.check(group)
        FORMATS[name] = WeightFormat(name, "fp8", group, fp8_blocks.block_bytes(group))
    return FORMATS[name]


def weight_format(kind: str) -> WeightFormat:
    if kind not in FORMATS and (spec := int_groups.parse_kind(kind)) is not None:
        return int_group_format(*spec)
    if kind not in FORMATS and (group := fp8_blocks.parse_kind(kind)) is not None:
        return fp8_format(group)
    try:
        return FORMATS[kind]
    except KeyError:
        raise ValueError(f"unknown weight format {kind!r} (known: {', '.join(FORMATS)}, I<bits>_G<group>, "
                         "F8E4M3_G<group>)") from None
