"""Integer-group blocks (GPTQ, AWQ, compressed-tensors) as MLX affine groups (backends/mlx/int_affine.py): bit for
bit what our dequantizer decodes, for 4 and 8 bits, groups MLX takes and wider ones (split into MLX groups sharing
scale and bias), matrices and expert stacks; and the bound on a weight's change when scales and biases are cast to
16 bits."""

from __future__ import annotations

import numpy as np
import pytest

from backends.mlx.gguf_affine import AffineWeight
from backends.mlx.int_affine import cast_error, to_affine
from backends.mlx.runtime import mx
from ir.formats import int_groups
from ir.weights import StoredTensor, stack


def random_int_groups(rng, rows: int, cols: int, bits: int, group: int) -> StoredTensor:
    q = rng.integers(0, 1 << bits, (rows, cols))
    scales = rng.standard_normal((rows, cols // group)).astype(np.float16).astype(np.float32)
    zeros = rng.integers(0, 1 << bits, (rows, cols // group))
    return StoredTensor(int_groups.pack(q, scales, zeros, bits, group), int_groups.kind_name(bits, group),
                        (rows, cols))


def mlx_dequantize(a: AffineWeight) -> np.ndarray:
    return np.array(mx.dequantize(mx.array(a.wq), mx.array(a.scales), mx.array(a.biases), group_size=a.group_size,
                                  bits=a.bits))


@pytest.mark.parametrize("bits,group,mlx_group", [(4, 32, 32), (4, 128, 128), (8, 64, 64), (4, 96, 32),
                                                  (8, 512, 128)])
def test_matrices_map_exactly(bits, group, mlx_group):
    t = random_int_groups(np.random.default_rng(bits * group), 5, 1024 if group != 96 else 960, bits, group)
    a = to_affine(t)
    assert (a.group_size, a.bits) == (mlx_group, bits)
    np.testing.assert_array_equal(mlx_dequantize(a), t.dequantize())


def test_expert_stacks_map_exactly():
    rng = np.random.default_rng(1)
    t = stack([random_int_groups(rng, 4, 256, 4, 256) for _ in range(3)])
    a = to_affine(t)
    assert a.wq.shape == (3, 4, 32) and a.scales.shape == (3, 4, 2)
    np.testing.assert_array_equal(mlx_dequantize(a), t.dequantize())


def test_cast_error_bounds_the_16_bit_weights():
    t = random_int_groups(np.random.default_rng(2), 8, 256, 4, 32)
    a = to_affine(t)
    s16 = np.array(mx.array(a.scales).astype(mx.bfloat16).astype(mx.float32))
    b16 = np.array(mx.array(a.biases).astype(mx.bfloat16).astype(mx.float32))
    err = cast_error(a, s16, b16)
    got = mlx_dequantize(AffineWeight(a.wq, s16, b16, a.group_size, a.bits))
    assert 0 < float(np.abs(got - t.dequantize()).max()) <= err
    assert cast_error(a, a.scales, a.biases) == 0.0
