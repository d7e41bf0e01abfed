"""GPTQ, AWQ and compressed-tensors `pack-quantized` linears read from an HF folder's safetensors into one StoredTensor
of the intgroup layout (ir/formats/int_groups.py), by the folder's `quantization_config`.

What each source stores (facts from the formats' public packers: AutoGPTQ/GPTQModel, AutoAWQ, compressed-tensors):
- GPTQ: `qweight` int32 [K * b / 32, N], input k of output n at bits b * (k % (32 / b)) of word [k // (32 / b), n];
  `qzeros` int32 [groups, N * b / 32] packed the same way along N; `scales` fp16 [groups, N]; `g_idx` int32 [K], the
  group of each input. checkpoint_format "gptq" (v1) stores each zero point minus one, "gptq_v2" as it is.
- AWQ (GEMM): `qweight` int32 [K, N / 8] and `qzeros` int32 [groups, N / 8], packed along N with the eight nibbles
  of a word holding outputs 0, 2, 4, 6, 1, 3, 5, 7 of its eight (nibble i at bits 4 i); `scales` fp16 [groups, N].
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K * b / 32], one little-endian bit stream per row
  (input k at bit k * b), values stored as q + 2**(b-1); `weight_scale` [N, groups]; asymmetric `weight_zero_point`
  packed the same way along N ([N * b / 32, groups], older files: int8 [N, groups]); `weight_shape` [N, K];
  `weight_g_idx` [K] with activation ordering.
Every one decodes to w[n, k] = (q - z) * s of k's group.

Act order (a g_idx that is not k // G) is resolved once here: columns are sorted by group so that groups are
contiguous, and the tensor records the permutation its input needs (StoredTensor.input_perm). Permuting x's K values
per step is one small gather; the alternative, a group index per column in the kernels, costs a lookup per weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ir.formats import int_groups
from ir.formats.errors import ModelFormatError
from ir.weight_formats import FORMATS, int_group_format
from ir.weights import StoredTensor

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output held by nibble i of an AWQ GEMM word


@dataclass(frozen=True)
class IntScheme:
    """What a folder's quantization_config says about its integer linears."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int
    group: int  # -1: one group per row
    sym: bool
    zeros_minus_one: bool = False  # GPTQ v1 checkpoints

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Tensor suffixes that mark a quantized linear `<prefix>.<suffix>`."""
        return ("weight_packed",) if self.method == "compressed-tensors" else ("qweight",)


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise ModelFormatError(path, f"unsupported quantization_config: {what}")


def scheme_from_config(qc: Mapping[str, Any], path: Path) -> IntScheme:
    """The scheme of a config.json's quantization_config, or a ModelFormatError naming what is not supported."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        _need(fmt in ("gptq", "gptq_v2"), path, f"GPTQ checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
        s = IntScheme("gptq", int(qc.get("bits", 4)), int(qc.get("group_size", 128)), bool(qc.get("sym", True)),
                      zeros_minus_one=fmt == "gptq")
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        _need(version == "gemm", path, f"AWQ version {version!r} (supported: gemm)")
        _need(bool(qc.get("zero_point", True)), path, "AWQ without zero points")
        s = IntScheme("awq", int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size",
                      128))), False)
        _need(s.bits == 4, path, f"{s.bits}-bit AWQ (AWQ GEMM packs 4 bits)")
    elif method == "compressed-tensors":
        s = _compressed_tensors(qc, path)
    else:
        raise ModelFormatError(path, f"unsupported quant_method {method!r} (supported: gptq, awq, compressed-tensors, "
                               "fp8)")
    _need(s.bits in int_groups.BITS, path, f"{s.bits}-bit weights (supported: 4, 8)")
    _need(s.group == -1 or (s.group > 0 and s.group % 32 == 0), path,
          f"group_size {s.group} (supported: -1 or a multiple of 32)")
    return s


def _compressed_tensors(qc: Mapping[str, Any], path: Path) -> IntScheme:
    groups = qc.get("config_groups") or {}
    _need(len(groups) == 1, path, f"{len(groups)} compressed-tensors config groups (supported: one)")
    (group,) = groups.values()
    fmt = str(group.get("format") or qc.get("format", "")).lower()
    _need(fmt == "pack-quantized", path,
          f"compressed-tensors format {fmt!r} (supported: pack-quantized, float-quantized)")
    _need(group.get("input_activations") is None, path, "quantized activations")
    w = group.get("weights") or {}
    _need(str(w.get("type", "int")) == "int", path, f"weights of type {w.get('type')!r} (supported: int)")
    strategy = str(w.get("strategy", ""))
    _need(strategy in ("group", "channel"), path, f"strategy {strategy!r} (supported: group, channel)")
    size = int(w.get("group_size") or 0) if strategy == "group" else -1
    return IntScheme("compressed-tensors", int(w.get("num_bits", 4)), size, bool(w.get("symmetric", True)))


def _unpack_along_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values [R * 32 / b, C] of int32 words [R, C] packing consecutive rows, low bits first."""
    per, mask = 32 // bits, np.uint32((1 << bits) - 1)
    w = np.ascontiguousarray(words).view(np.uint32)
    out = np.empty((w.shape[0], per, w.shape[1]), np.uint8)  # one field at a time: a byte a value, no wide temporaries
    for i in range(per):
        out[:, i] = (w >> np.uint32(bits * i)) & mask
    return out.reshape(-1, w.shape[1])


def _unpack_along_cols(words: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values [R, C * 32 / b] of int32 words [R, C] packing consecutive columns, low bits first."""
    return np.ascontiguousarray(_unpack_along_rows(np.ascontiguousarray(words.T), bits).T)


def _array(tensors: Mapping, name: str, path: Path) -> np.ndarray:
    if name not in tensors:
        raise ModelFormatError(path, f"missing tensor {name!r} of a quantized linear")
    return np.asarray(tensors[name].data)


def float_tensor(tensors: Mapping, name: str, path: Path) -> np.ndarray:
    """A float tensor (scales: fp16, bf16 or fp32) as fp32."""
    _array(tensors, name, path)  # present
    t = tensors[name]
    fmt = FORMATS.get(t.dtype)
    if fmt is None or fmt.quantized:
        raise ModelFormatError(path, f"tensor {name!r} has dtype {t.dtype}; expected a float type")
    return StoredTensor(t.data, t.dtype, t.shape, name).values().astype(np.float32).reshape(t.shape)


def read_linear(tensors: Mapping, prefix: str, s: IntScheme, path: Path) -> StoredTensor:
    """The linear `prefix` (e.g. model.layers.0.mlp.up_proj) of a quantized checkpoint as one intgroup tensor."""
    if s.method == "gptq":
        q, z, scales, g_idx = _gptq(tensors, prefix, s, path)
        source = f"{prefix}.qweight"
    elif s.method == "awq":
        q, z, scales, g_idx = _awq(tensors, prefix, s, path)
        source = f"{prefix}.qweight"
    else:
        q, z, scales, g_idx = _ct(tensors, prefix, s, path)
        source = f"{prefix}.weight_packed"
    n, k = q.shape
    group = k if s.group == -1 else s.group
    if k % group or scales.shape != (n, k // group) or z.shape != scales.shape:
        raise ModelFormatError(path, f"{source}: [{n}, {k}] weights with scales {list(scales.shape)} and zero points "
                               f"{list(z.shape)} are not groups of {group}")
    perm = None
    if g_idx is not None and not np.array_equal(g_idx, np.arange(k) // group):
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        if not np.array_equal(g_idx[perm], np.arange(k) // group):
            raise ModelFormatError(path, f"{prefix}.g_idx: groups are not of {group} inputs each")
        q = q[:, perm]
    fmt = int_group_format(s.bits, group)
    return StoredTensor(int_groups.pack(q, scales, z, s.bits, group), fmt.name, (n, k), source, perm)


def _gptq(tensors, prefix, s, path):
    qw = _array(tensors, f"{prefix}.qweight", path)
    q = _unpack_along_rows(qw, s.bits).T  # [N, K]
    zeros = _unpack_along_cols(_array(tensors, f"{prefix}.qzeros", path), s.bits)  # [groups, N (padded)]
    if s.zeros_minus_one:
        zeros = (zeros + 1) & ((1 << s.bits) - 1)
    scales = float_tensor(tensors, f"{prefix}.scales", path)
    g_idx = np.asarray(tensors[f"{prefix}.g_idx"].data).astype(np.int64) if f"{prefix}.g_idx" in tensors else None
    n = scales.shape[1]
    return q, zeros[:, :n].T, scales.T, g_idx


def _awq(tensors, prefix, s, path):
    def unpack(words):
        v = _unpack_along_cols(words, 4)  # nibble order within each word: outputs _AWQ_ORDER of its eight
        out = np.empty_like(v)
        for i, col in enumerate(_AWQ_ORDER):
            out[:, col::8] = v[:, i::8]
        return out

    q = unpack(_array(tensors, f"{prefix}.qweight", path)).T  # [N, K]
    zeros = unpack(_array(tensors, f"{prefix}.qzeros", path))
    return q, zeros.T, float_tensor(tensors, f"{prefix}.scales", path).T, None


def _ct(tensors, prefix, s, path):
    n, k = (int(d) for d in _array(tensors, f"{prefix}.weight_shape", path).reshape(-1)[:2])
    q = _unpack_along_cols(_array(tensors, f"{prefix}.weight_packed", path), s.bits)[:, :k]
    scales = float_tensor(tensors, f"{prefix}.weight_scale", path).reshape(n, -1)
    offset = 1 << (s.bits - 1)  # values are stored as signed + offset, zero points alike
    if s.sym:
        zeros = np.full(scales.shape, offset, np.uint8)
    else:
        zp = _array(tensors, f"{prefix}.weight_zero_point", path)
        if zp.dtype == np.int32:  # packed along N
            zeros = _unpack_along_rows(zp, s.bits)[:n]
        else:
            zeros = (zp.astype(np.int16) + offset).astype(np.uint8)
        zeros = zeros.reshape(n, -1)
    gi = f"{prefix}.weight_g_idx"
    g_idx = np.asarray(tensors[gi].data).astype(np.int64) if gi in tensors else None
    return q, zeros, scales, g_idx


def linear_prefixes(names, s: IntScheme) -> set[str]:
    """The quantized linears of a checkpoint, by the tensors that mark them."""
    out = set()
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in s.suffixes:
            out.add(prefix)
    return out
