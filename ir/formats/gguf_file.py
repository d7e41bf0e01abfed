"""A GGUF reader: metadata as plain Python values, tensors as raw memory-mapped blocks.

Written here rather than taken from gguf-py's GGUFReader because a malformed or truncated file must
give one line naming the file and the problem, and GGUFReader fails deep inside numpy instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ir.formats.errors import ModelFormatError
from ir.formats.gguf_quants import QTYPES, spec

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
       12: "<f8"}
_STRING, _ARRAY = 8, 9
_BY_ID = {q.ggml_type: q.name for q in QTYPES.values()}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols] for a matrix (GGUF's ne reversed)
    qtype: str
    data: np.ndarray  # uint8 [rows, row_bytes] view into the file


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(self.path, f"{what} (at byte {self.pos} of {len(self.buf)})")

    def take(self, n: int, what: str) -> np.ndarray:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated while reading {what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what).tobytes())[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        try:
            return self.take(n, what).tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8") from e

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype], what)
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.scalar("<I", what), self.scalar("<Q", what)
            if etype in _NP:
                raw = self.take(count * np.dtype(_NP[etype]).itemsize, what)
                arr = raw.view(_NP[etype])
                return [bool(x) for x in arr] if etype == 7 else arr.tolist()
            if count > len(self.buf):
                raise self.fail(f"{what}: array length {count} is impossible")
            return [self.value(etype, what) for _ in range(count)]
        raise self.fail(f"{what}: unknown value type {vtype}")


class GGUFFile:
    """`metadata` maps keys to Python values; `tensors` maps names to raw blocks, in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelFormatError(self.path, f"cannot read: {e}") from e
        c = _Cursor(buf, self.path)
        if c.take(4, "the magic number").tobytes() != b"GGUF":
            raise ModelFormatError(self.path, "not a GGUF file (bad magic number)")
        version = c.scalar("<I", "the version")
        if version not in (2, 3):
            raise ModelFormatError(self.path, f"unsupported GGUF version {version} (big-endian or too old?)")
        n_tensors, n_kv = c.scalar("<Q", "the tensor count"), c.scalar("<Q", "the metadata count")
        if n_tensors > len(buf) or n_kv > len(buf):
            raise c.fail(f"impossible counts: {n_tensors} tensors, {n_kv} metadata keys")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            self.metadata[key] = c.value(c.scalar("<I", f"type of {key!r}"), f"metadata {key!r}")
        infos = [self._tensor_info(c, i) for i in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, offset in infos:
            q = spec(qtype)
            row = shape[-1] if shape else 1
            rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            if row % q.block_size:
                raise ModelFormatError(self.path, f"tensor {name!r}: row of {row} is not a multiple of "
                                       f"the {qtype} block size {q.block_size}")
            nbytes = rows * (row // q.block_size) * q.type_size
            begin = start + offset
            if begin + nbytes > len(buf):
                raise ModelFormatError(self.path, f"truncated: tensor {name!r} needs bytes {begin}..{begin + nbytes}"
                                       f" but the file has {len(buf)}")
            data = buf[begin : begin + nbytes].reshape(rows, nbytes // rows)
            self.tensors[name] = GGUFTensor(name, shape, qtype, data)

    def _tensor_info(self, c: _Cursor, i: int) -> tuple[str, tuple[int, ...], str, int]:
        name = c.string(f"tensor name #{i}")
        n_dims = c.scalar("<I", f"dims of {name!r}")
        if n_dims > 8:
            raise c.fail(f"tensor {name!r} claims {n_dims} dimensions")
        ne = [c.scalar("<Q", f"shape of {name!r}") for _ in range(n_dims)]
        type_id = c.scalar("<I", f"type of {name!r}")
        if type_id not in _BY_ID:
            raise c.fail(f"tensor {name!r} has unsupported type id {type_id} "
                         f"(supported: {', '.join(sorted(QTYPES))})")
        offset = c.scalar("<Q", f"offset of {name!r}")
        return name, tuple(int(d) for d in reversed(ne)), _BY_ID[type_id], offset
