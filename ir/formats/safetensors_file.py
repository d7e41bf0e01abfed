"""A safetensors reader on numpy memory maps.

The `safetensors` package's numpy API cannot return bf16 tensors, and its errors do not name the
problem in a way a user can act on; the format is a length, a JSON header and raw little-endian data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ir.formats.errors import ModelFormatError

# bf16 has no numpy dtype: it is kept as its raw 16 bits and widened where a consumer asks.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
          "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?", "U16": "<u2", "U32": "<u4", "U64": "<u8",
          "F8_E4M3": "u1", "F8_E5M2": "u1"}


@dataclass(frozen=True)
class SafeTensor:
    name: str
    dtype: str  # the safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    data: np.ndarray  # typed view into the file (uint16 for BF16)


def read_safetensors(path: str | Path) -> dict[str, SafeTensor]:
    path = Path(path)
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise ModelFormatError(path, f"cannot read: {e}") from e
    if len(buf) < 8:
        raise ModelFormatError(path, f"truncated: {len(buf)} bytes, not even a header length")
    n = int(buf[:8].view("<u8")[0])
    if 8 + n > len(buf):
        raise ModelFormatError(path, f"truncated or not safetensors: header claims {n} bytes, file has {len(buf)}")
    try:
        header = json.loads(buf[8 : 8 + n].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"malformed header JSON: {e}") from e
    if not isinstance(header, dict):
        raise ModelFormatError(path, "malformed header: not a JSON object")
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(path, f"tensor {name!r}: malformed header entry {info!r}") from e
        if dtype not in DTYPES:
            raise ModelFormatError(path, f"tensor {name!r}: unsupported dtype {dtype}")
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        want = int(np.prod(shape, dtype=np.int64)) * itemsize
        if end - begin != want or begin < 0:
            raise ModelFormatError(path, f"tensor {name!r}: {end - begin} bytes for shape {list(shape)} {dtype}"
                                   f" (needs {want})")
        if base + end > len(buf):
            raise ModelFormatError(path, f"truncated: tensor {name!r} needs bytes up to {base + end},"
                                   f" the file has {len(buf)}")
        data = buf[base + begin : base + end].view(DTYPES[dtype]).reshape(shape)
        out[name] = SafeTensor(name, dtype, shape, data)
    return out


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF model folder: from the shard index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(index, f"malformed shard index: {e}") from e
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelFormatError(index, f"shards missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(folder, "no *.safetensors files in this folder")
    return files
