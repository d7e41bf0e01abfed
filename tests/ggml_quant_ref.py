"""ggml's own reference quantizers (quantize_row_*_ref from ggml-quants.c), compiled from llama.cpp's source tarball
with the system C compiler into a small shared library and called through ctypes: the independent oracle for
ir/formats/gguf_quantize.py. None (with the reason) where the tarball or a compiler is missing."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np

from ir.formats.gguf_quants import spec
from tools import synth_gguf

# ggml-quants.c calls these only on its error and validation paths, which the reference quantizers never take.
_STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "%s:%d\n", file, line); abort(); }
size_t ggml_row_size(int type, long long ne) { (void) type; (void) ne; abort(); }
const char * ggml_type_name(int type) { (void) type; return "?"; }
size_t ggml_type_size(int type) { (void) type; abort(); }
"""

_FUNCS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
          "Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K"}


def _wanted(name: str) -> bool:
    return name.startswith(("llc/ggml/include/", "llc/ggml/src/")) and name.endswith(".h") or \
        name == "llc/ggml/src/ggml-quants.c"


def build(workdir: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why it could not be built)."""
    tgz = next((p for p in synth_gguf.src_tarballs() if p.is_file()), None)
    if tgz is None:
        return None, "llama.cpp-src.tgz is in neither .peers/ nor ../shared/peers"
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    with tarfile.open(tgz) as tf:
        tf.extractall(workdir, members=[m for m in tf.getmembers() if m.isfile() and _wanted(m.name)],
                      filter="data")
    ggml = workdir / "llc" / "ggml"
    (workdir / "stubs.c").write_text(_STUBS)
    lib = workdir / "libggml_quants_ref.so"
    # -ffp-contract=off: no fused multiply-adds, so the C rounds every product as the scalar reference is written.
    cmd = [cc, "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-DNDEBUG", f"-I{ggml / 'include'}",
           f"-I{ggml / 'src'}", f"-I{ggml / 'src' / 'ggml-cpu'}", str(ggml / "src" / "ggml-quants.c"),
           str(workdir / "stubs.c"), "-o", str(lib), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"compiling ggml-quants.c failed: {r.stderr[-500:]}"
    dll = ctypes.CDLL(str(lib))
    for f in _FUNCS.values():
        getattr(dll, f"quantize_row_{f}_ref").argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return dll, ""


def quantize(dll: ctypes.CDLL, x: np.ndarray, kind: str) -> np.ndarray:
    """ggml's quantize_row_<kind>_ref over x's rows: uint8 [rows, row bytes]."""
    s = spec(kind)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.zeros((x.shape[0], x.shape[1] // s.block_size * s.type_size), dtype=np.uint8)
    fn = getattr(dll, f"quantize_row_{_FUNCS[s.name]}_ref")
    for r in range(x.shape[0]):
        fn(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
    return out
