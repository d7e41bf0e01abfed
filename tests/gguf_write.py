"""What the tests that write GGUF files share: a tensor added in F32, F16 or Q8_0 (gguf-py quantizing, an independent
packer), and the file written out."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q = Q.F32) -> Q:
    """fp32 `data` stored as `qtype` (F32, F16 or Q8_0); returns qtype."""
    if qtype == Q.F16:
        data = data.astype(np.float16)
    elif qtype == Q.Q8_0:
        data = gguf.quants.quantize(data, qtype)
    w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype if qtype == Q.Q8_0 else None)
    return qtype


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
