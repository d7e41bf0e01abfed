"""Integer-group weights (GPTQ, AWQ, compressed-tensors; the intgroup layout of ir/formats/int_groups.py) as MLX
affine groups, exactly: each block already decodes as q * scale + bias in fp32 with MLX's bit order, so its q bytes
are MLX's packed words and a group wider than MLX's widest (128) becomes several MLX groups sharing its scale and bias.
What can lose precision is the compute dtype that convert() casts scales and biases to (bias = -z * s needs up to 8
more mantissa bits than s): `cast_error` measures that bound so the loader can log it."""

from __future__ import annotations

import numpy as np

from backends.mlx.gguf_affine import AffineWeight
from ir.formats import int_groups
from ir.weights import StoredTensor

MLX_GROUPS = (128, 64, 32)  # the group sizes mx.quantized_matmul takes, widest first


def to_affine(t: StoredTensor) -> AffineWeight | str:
    """The MLX affine form of an intgroup matrix, or stack of them (experts [E, out, in], as gather_qmm takes; columns
    in stored order: t.input_perm says the input order), or why it has none."""
    if len(t.shape) < 2:
        return f"{t.kind}: shape {t.shape} is not a matrix"
    bits, group = t.format.int_group
    *lead, cols = t.shape
    qbytes, scales, biases = int_groups.split(t.data, bits, group, int(np.prod(lead)), cols)
    mlx_group = next(g for g in MLX_GROUPS if group % g == 0)  # int_groups keeps groups multiples of 32
    rep = group // mlx_group
    wq = np.ascontiguousarray(qbytes).view("<u4").astype(np.uint32, copy=False).reshape(*lead, -1)
    per_row = cols // mlx_group
    return AffineWeight(wq, np.repeat(scales, rep, axis=1).reshape(*lead, per_row),
                        np.repeat(biases, rep, axis=1).reshape(*lead, per_row), mlx_group, bits)


def cast_error(a: AffineWeight, scales: np.ndarray, biases: np.ndarray) -> float:
    """The largest change of a weight when a's scales and biases become `scales` and `biases` (the compute dtype's
    values, read back as f32): |d scale| * q_max + |d bias| over the groups."""
    q_max = (1 << a.bits) - 1
    return float((np.abs(scales - a.scales) * q_max + np.abs(biases - a.biases)).max(initial=0.0))
