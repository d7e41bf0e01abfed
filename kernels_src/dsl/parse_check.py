"""Parse checks of generated sources with libclang (`pip install libclang`), no Metal or CUDA toolkit needed.

Metal: the source as MLX wraps it (header, the [[kernel]] signature MLX writes, our body), parsed as C++17 after
metal_shim.h; CUDA C: the full kernel after cuda_shim.h. What a compiler would reject in the text itself is
caught: undeclared names, type errors, mixed address spaces, writes through const pointers. Semantics are the
CPU oracle's business (cpu_target.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
STUBS = "/dsl-parse-stubs"  # a virtual include directory: its headers are given as unsaved files
# Valid Metal that C++ rejects: a threadgroup array declared in the kernel body.
_ALLOWED = ("automatic variable qualified with an address space", "threadgroup ")


@dataclass(frozen=True)
class Problem:
    line: int
    message: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}\n    {self.text.strip()}"


def parse(source: str, shim: str, stubs: dict[str, str]) -> list[Problem]:
    """Errors libclang finds in `source` (C++17 after the shim header `shim`); [] when it parses cleanly."""
    import clang.cindex as ci

    args = ["-x", "c++", "-std=c++17", "-fsyntax-only", "-nostdinc", "-nostdinc++", "-ferror-limit=0",
            "-Wno-unknown-attributes", "-include", str(HERE / shim), "-I", STUBS]
    unsaved = [("kernel.cpp", source)] + [(f"{STUBS}/{name}", text) for name, text in stubs.items()]
    tu = ci.Index.create().parse("kernel.cpp", args=args, unsaved_files=unsaved)
    lines = source.splitlines()
    out = []
    for d in tu.diagnostics:
        if d.severity < ci.Diagnostic.Error:
            continue
        in_source = d.location.file is not None and d.location.file.name == "kernel.cpp"
        text = lines[d.location.line - 1] if in_source and 0 < d.location.line <= len(lines) else ""
        if d.spelling == _ALLOWED[0] and text.lstrip().startswith(_ALLOWED[1]):
            continue
        where = d.location.line if in_source else f"{d.location.file}:{d.location.line}"
        out.append(Problem(where, d.spelling, text))
    return out


def check_metal(wrapped: str) -> list[Problem]:
    """Problems in a Metal kernel as MLX compiles it (metal_target.mlx_wrapped_source / wrap_like_mlx)."""
    return parse(wrapped, "metal_shim.h", {"metal_stdlib": ""})


def check_cuda(source: str) -> list[Problem]:
    return parse(source, "cuda_shim.h", {"cuda_fp16.h": "", "cuda_bf16.h": ""})
