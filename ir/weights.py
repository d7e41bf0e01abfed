"""The weight store: every tensor as it was stored (typed array, raw bf16 bits or raw GGUF blocks).

Quantized tensors stay quantized; a consumer that needs dense values calls `dequantize()`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np

from ir.formats.errors import ModelFormatError
from ir.weight_formats import FORMATS, WeightFormat, weight_format


@dataclass(frozen=True)
class StoredTensor:
    data: np.ndarray  # f32/f16 array, uint16 bf16 bits, or uint8 blocks [rows, row_bytes] (GGUF or intgroup)
    kind: str  # "F32", "F16", "BF16", a GGUF quant type such as "Q4_K", or integer groups such as "I4_G128"
    shape: tuple[int, ...]  # logical shape, [out, in] for a matrix
    source: str = ""  # the tensor's name in its file
    # Integer groups of an act-order (GPTQ desc_act) checkpoint are stored with their columns sorted by group, so
    # that groups are contiguous: column j holds input input_perm[j], and x @ W.T == x[..., input_perm] @ stored.T.
    input_perm: np.ndarray | None = None

    @property
    def format(self) -> WeightFormat:
        return weight_format(self.kind)

    @property
    def quantized(self) -> bool:
        fmt = FORMATS.get(self.kind)  # a kind no reader produces (a ggml type we lack) is not dense either
        return fmt is None or fmt.quantized

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def values(self) -> np.ndarray:
        """The tensor as floats: f32/f16 data as stored (no copy), bf16 bits and GGUF blocks decoded to f32."""
        return self.data if self.data.dtype in (np.float32, np.float16) else self.dequantize()

    def dequantize(self) -> np.ndarray:
        w = self.format.dequantize(self.data, self.shape)
        if self.input_perm is None:
            return w
        out = np.empty_like(w)
        out[..., self.input_perm] = w  # back to the inputs' own order
        return out

    def as_elements(self) -> StoredTensor:
        """The tensor with `data` as elements of its logical shape, for splits along any axis: dense data typed
        (GGUF's raw F32/F16/BF16 bytes viewed as their elements, no copy), quantized blocks decoded to F32."""
        if self.quantized:
            return StoredTensor(self.dequantize().reshape(self.shape), "F32", self.shape, self.source)
        data = self.data
        if data.dtype == np.uint8:  # a GGUF reader's raw bytes
            data = np.ascontiguousarray(data).reshape(-1).view(self.format.element_dtype)
        return StoredTensor(data.reshape(self.shape), self.kind, self.shape, self.source)

    def permute_rows(self, perm: np.ndarray) -> StoredTensor:
        """Reorder output rows; valid for quantized blocks too, since a block never spans two rows."""
        rows = self.data.reshape(self.shape[0], -1)  # 1-D tensors arrive from GGUF as one row of bytes
        out = np.ascontiguousarray(rows[perm]).reshape(self.data.shape)
        return replace(self, data=out)


    def rows(self, start: int, stop: int) -> StoredTensor:
        """Output rows start:stop (a fused qkv_proj's q, k or v part); quantized blocks split as they lie, since a
        block never spans two rows."""
        rows = np.ascontiguousarray(self.data.reshape(self.shape[0], -1)[start:stop])
        # A 1-D tensor (a fused bias) arrives from GGUF as one row of bytes, and stays one.
        data = rows.reshape((stop - start, *self.data.shape[1:])) if self.data.shape[0] == self.shape[0] else \
            rows.reshape(1, -1)
        return replace(self, data=data, shape=(stop - start, *self.shape[1:]))

    def rows_of_each(self, start: int, count: int) -> StoredTensor:
        """Rows start:start+count of every matrix of a stack [n, rows, cols] (a fused gate_up stack's halves)."""
        n, rows = self.shape[0], self.shape[1]
        data = self.data.reshape(n, rows, -1)[:, start:start + count]
        # Typed elements keep their shape; bytes (quantized blocks, or a GGUF reader's raw F32/F16) stay rows of bytes.
        typed = self.data.size == np.prod(self.shape)
        out = np.ascontiguousarray(data).reshape((n, count, *self.shape[2:]) if typed else (n * count, -1))
        return replace(self, data=out, shape=(n, count, *self.shape[2:]))

    def reshaped(self, shape: tuple[int, ...]) -> StoredTensor:
        """The same values under another logical shape with the same last dimension (blocks stay whole)."""
        if np.prod(shape) != np.prod(self.shape) or shape[-1] != self.shape[-1]:
            raise ValueError(f"cannot view {self.shape} as {shape}")
        # Typed values take the shape; raw bytes (blocks, or a GGUF vector's one row) decode by the logical shape.
        data = self.data.reshape(shape) if self.data.size == np.prod(shape) else self.data
        return replace(self, data=data, shape=tuple(shape))

    def dense_map(self, fn) -> StoredTensor:
        """fn(values as f32) as an F32 tensor: a per-source fix-up of small dense tensors (gemma's 1 + w norms)."""
        out = np.ascontiguousarray(fn(self.values().astype(np.float32)), dtype=np.float32)
        return StoredTensor(out, "F32", self.shape, self.source)


def stack(parts: list[StoredTensor]) -> StoredTensor:
    """Tensors of one shape as a stack [n, ...] (an MoE layer's experts): quantized blocks row after row, as a
    GGUF expert stack lies; parts of different formats (or act-order columns, each in its own order) meet as F32."""
    first = parts[0]
    if any(p.shape != first.shape for p in parts):
        raise ValueError(f"cannot stack shapes {sorted({p.shape for p in parts})}")
    shape = (len(parts), *first.shape)
    if any(p.kind != first.kind or p.input_perm is not None for p in parts):
        return StoredTensor(np.stack([p.values().astype(np.float32).reshape(p.shape) for p in parts]), "F32", shape,
                            first.source)
    if first.quantized:
        data = np.concatenate([p.data.reshape(-1, p.data.shape[-1]) for p in parts])
    else:
        data = np.stack([p.data.reshape(p.shape) for p in parts])
    return StoredTensor(data, first.kind, shape, first.source)


class WeightSource(Collection[str]):
    """The tensors of one model file as an architecture's load_weights sees them: by the file's own names, in its
    format ("hf": safetensors, "gguf"), each fetched (memory-mapped) on first use. As a collection of names it is
    also what a GGUF config reader gets: what is present describes the model, and a few small tensors (Phi-3's
    rope_factors_long / _short) are read there."""

    def __init__(self, fmt: str, path, fetch, names: Iterable[str], on_fetch=None):
        self.format, self.path = fmt, path
        self._fetch, self._names, self.on_fetch = fetch, frozenset(names), on_fetch

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def names(self) -> frozenset[str]:
        return self._names

    def get(self, name: str) -> StoredTensor | None:
        if name not in self._names:
            return None
        t = self._fetch(name)
        if self.on_fetch is not None:  # a progress bar
            self.on_fetch(name)
        return t

    def require(self, name: str, param: str = "") -> StoredTensor:
        t = self.get(name)
        if t is None:
            for_param = f" (for parameter {param})" if param else ""
            raise ModelFormatError(self.path, f"missing tensor {name!r}{for_param}")
        return t


class WeightStore(Mapping[str, StoredTensor]):
    """IR parameter name -> stored tensor."""

    def __init__(self, tensors: dict[str, StoredTensor] | None = None):
        self._t: dict[str, StoredTensor] = dict(tensors or {})

    def __getitem__(self, name: str) -> StoredTensor:
        return self._t[name]

    def __setitem__(self, name: str, t: StoredTensor) -> None:
        self._t[name] = t

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._t.values())

    def kinds(self) -> dict[str, str]:
        return {k: t.kind for k, t in self._t.items()}


def rope_unpermute_rows(rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (which interleaves each head's two rotary
    halves for ggml's rope), giving back the HF neox layout."""
    head_dim = rows // n_heads
    return np.arange(rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
