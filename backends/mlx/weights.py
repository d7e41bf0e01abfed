"""IR parameters as mlx arrays: dense in the compute dtype, or GGUF blocks as MLX affine quantization."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from backends.mlx.runtime import mx
from ir.graph import Graph
from ir.weights import StoredTensor

log = logging.getLogger(__name__)

DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


@dataclass
class QuantLinear:
    """A matrix kept as MLX affine groups: w = scales * q + biases per group of `group_size`."""

    wq: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int
    perm: mx.array | None = None  # act-order columns (StoredTensor.input_perm): the input order they need

    def matmul(self, x: mx.array) -> mx.array:
        if self.perm is not None:
            x = mx.take(x, self.perm, axis=-1)
        return mx.quantized_matmul(x, self.wq, self.scales, self.biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits)

    def rows(self, ids: mx.array) -> mx.array:
        if self.perm is not None:
            raise ValueError("an act-order matrix is a linear's weight, not a table of rows")
        return mx.dequantize(self.wq[ids], self.scales[ids], self.biases[ids], group_size=self.group_size,
                             bits=self.bits).astype(self.scales.dtype)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.scales.nbytes + self.biases.nbytes


def dense_array(t: StoredTensor, shape: tuple[int, ...], dtype) -> mx.array:
    return mx.array(np.ascontiguousarray(t.values()).reshape(shape)).astype(dtype)


def _no_fp8(t: StoredTensor) -> str:
    return "MLX has no FP8 matmul: dequantized at load"


def convert(graph: Graph, weights, dtype: str, quantized: bool, progress: bool = True):
    """Returns ({param: mx.array | QuantLinear}, {fallback reason: count})."""
    from backends.mlx import int_affine
    from backends.mlx.gguf_affine import to_affine

    mdtype = DTYPES[dtype]
    matrices = graph.matrix_params()
    params, fallbacks = {}, Counter()
    for name, p in tqdm(graph.params.items(), desc="to mlx", unit="tensor", disable=not progress, leave=False):
        t = weights[name]
        if quantized and name in matrices and t.quantized:
            # Quantized format family -> its MLX form (affine groups) or why it has none.
            convert_family = {"gguf": to_affine, "intgroup": int_affine.to_affine, "fp8": _no_fp8}.get(t.format.family)
            aw = convert_family(t) if convert_family else f"no MLX form for {t.format.family} weights"
            if isinstance(aw, str):
                fallbacks[f"{t.kind}: {aw}"] += 1
                log.info("%s (%s) falls back to dense %s: %s", name, t.kind, dtype, aw)
            else:
                scales, biases = mx.array(aw.scales).astype(mdtype), mx.array(aw.biases).astype(mdtype)
                perm = None if t.input_perm is None else mx.array(t.input_perm.astype(np.int32))
                if t.format.family == "intgroup" and mdtype != mx.float32:
                    err = int_affine.cast_error(aw, np.array(scales.astype(mx.float32)),
                                                np.array(biases.astype(mx.float32)))
                    if err > 0:
                        log.info("%s (%s): scales and biases in %s move a weight by up to %.3g", name, t.kind,
                                 dtype, err)
                params[name] = QuantLinear(mx.array(aw.wq), scales, biases, aw.group_size, aw.bits, perm)
                continue
        params[name] = dense_array(t, p.shape, mdtype)
    mx.eval([x for v in params.values() for x in arrays(v)])
    return params, fallbacks


def arrays(p) -> tuple:
    return (p,) if isinstance(p, mx.array) else (p.wq, p.scales, p.biases) + (() if p.perm is None else (p.perm,))


def format_of(p) -> str:
    """What the fusion pass compares: parts of one format may be concatenated (act-order parts never: each has its
    own input order)."""
    if not isinstance(p, QuantLinear):
        return f"dense {p.dtype}"
    return f"affine {p.bits}-bit, groups of {p.group_size}" + ("" if p.perm is None else f", act order {id(p)}")


def concat(parts: list):
    """Parts of one format, concatenated by rows (affine groups never span two rows)."""
    if isinstance(parts[0], QuantLinear):
        cat = lambda name: mx.concatenate([getattr(p, name) for p in parts], axis=0)  # noqa: E731
        return QuantLinear(cat("wq"), cat("scales"), cat("biases"), parts[0].group_size, parts[0].bits)
    return mx.concatenate(parts, axis=0)
