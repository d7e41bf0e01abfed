"""IR parameters as torch tensors on the device: dense in the compute dtype, GGUF and integer-group blocks kept as raw
bytes, FP8 weights as their e4m3 bytes and scales where the device has FP8 (backends/cuda/fp8_linear.py).

A fused parameter (ir.fusion: q/k/v or gate/up as one matrix, so that one GEMM or GEMV streams them together) is
its parts concatenated here, on the device, in the form the parts already have.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from backends.cuda import fp8_linear
from backends.cuda.runtime import torch
from ir.formats import fp8_blocks
from ir.graph import Graph
from ir.weights import StoredTensor
from kernels_src.dequant_gemv import QTYPES as KERNEL_QTYPES  # every quantized GGUF type ir/formats reads

log = logging.getLogger(__name__)

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class QuantWeight:
    """A GGUF tensor (a matrix [rows, cols], or a stack of them) kept as its blocks: uint8 [rows, row_bytes] on the
    device, rows = every dimension but the last."""

    data: torch.Tensor
    qtype: str
    shape: tuple[int, ...]
    perm: torch.Tensor | None = None  # act-order integer groups: the input order of the stored columns (int64)
    scales: torch.Tensor | None = None  # FP8: data is the e4m3 bytes [N, K], these their f32 scales [N, K / group]
    blocks: torch.Tensor | None = None  # FP8 in 128 x 128 blocks: the scales once a block, [N / 128, K / 128]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + sum(0 if t is None else t.numel() * 4 for t in (self.scales, self.blocks))


Param = torch.Tensor | QuantWeight


def nbytes(p: Param) -> int:
    return p.nbytes if isinstance(p, QuantWeight) else p.numel() * p.element_size()


def _host(arr: np.ndarray) -> torch.Tensor:
    """A CPU tensor over `arr` without a copy; the arrays of a memory-mapped file are read-only, and nothing
    writes to them (the tensor is only copied to the device)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(arr))


def _dense(t: StoredTensor, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    return _host(t.values().reshape(shape)).to(device=device, dtype=dtype)


def to_device(graph: Graph, weights, dtype: str, device, quantized: bool = True,
              progress: bool = True) -> tuple[dict[str, Param], Counter]:
    """({param: tensor | QuantWeight}, {why a quantized tensor became dense: count}); GGUF matrices stay
    quantized when `quantized` and the kernels support their format (all ten quantized types the loader reads:
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K)."""
    tdtype = DTYPES[dtype]
    matrices = graph.matrix_params()
    params: dict[str, Param] = {}
    fallbacks: Counter = Counter()
    for name, p in tqdm(graph.params.items(), desc="to device", unit="tensor", disable=not progress, leave=False):
        t = weights[name]
        if quantized and t.quantized and name in matrices:
            keep = KEEP.get(t.format.family)
            why = keep(t, device) if keep is not None else f"no CUDA kernel takes {t.format.family} weights"
            if why is None and t.format.family == "fp8":
                codes, scales = fp8_blocks.split(t.data, t.format.block_elems, *p.shape)
                blocks = fp8_linear.block_scales(scales, p.shape[1])
                params[name] = QuantWeight(_host(codes).to(device), t.kind, p.shape, None, _host(scales).to(device),
                                           None if blocks is None else _host(blocks).to(device))
                continue
            if why is None:
                blocks = np.ascontiguousarray(t.data).reshape(t.format.stored_shape(p.shape))
                perm = None if t.input_perm is None else _host(t.input_perm.astype(np.int64)).to(device)
                params[name] = QuantWeight(_host(blocks).to(device), t.kind, p.shape, perm)
                continue
            fallbacks[f"{t.kind}: {why}"] += 1
        params[name] = _dense(t, p.shape, tdtype, device)
    return params, fallbacks


def _gguf_kernels(t: StoredTensor, device) -> str | None:
    return None if t.kind in KERNEL_QTYPES else "no CUDA kernel for this format"


def _int_group_kernels(t: StoredTensor, device) -> str | None:
    return None if len(t.shape) == 2 else "no CUDA kernel for stacks of integer-group matrices"


def _fp8_kernels(t: StoredTensor, device) -> str | None:
    return fp8_linear.no_fp8(device) or (None if len(t.shape) == 2 else "no CUDA kernel for stacks of FP8 matrices")


# Quantized format family -> whether the kernels take a tensor as it is stored on `device` (None) or why not. The
# formats themselves are told apart in ir/weight_formats.py; each kernel file lists the formats it decodes.
KEEP = {"gguf": _gguf_kernels, "intgroup": _int_group_kernels, "fp8": _fp8_kernels}


def format_of(p: Param) -> str:
    """What the fusion pass compares: parts of one format may be concatenated (act-order parts never: each has its
    own input order)."""
    if not isinstance(p, QuantWeight):
        return f"dense {p.dtype}"
    return p.qtype if p.perm is None else f"{p.qtype}, act order {id(p)}"


def concat(parts: list[Param]) -> Param:
    """Parts of one format, concatenated by rows (quantized blocks too: a block never spans two rows)."""
    if isinstance(parts[0], QuantWeight):
        data = torch.cat([p.data for p in parts], dim=0)
        scales = None if parts[0].scales is None else torch.cat([p.scales for p in parts], dim=0)
        blocks = None if any(p.blocks is None for p in parts) else torch.cat([p.blocks for p in parts], dim=0)
        return QuantWeight(data, parts[0].qtype, (sum(p.shape[0] for p in parts), *parts[0].shape[1:]), None, scales,
                           blocks)
    return torch.cat(parts, dim=0)
