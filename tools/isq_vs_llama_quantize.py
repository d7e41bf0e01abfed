"""--isq's quantizers against llama.cpp's own `llama-quantize` binary (../shared/peers), byte for byte.

Writes a synthetic F16 llama GGUF (tools/synth_gguf), has `llama-quantize --pure` turn it into each plain type (every
matrix of that one type: Q3_K_S/Q4_K_S/Q5_K_S are Q3_K/Q4_K/Q5_K throughout), and compares every quantized tensor's
blocks with ir/formats/gguf_quantize.py's on the same F16 values. Where bytes differ it prints the differing rows and
the dequantized difference relative to the values' RMS. The binaries are the GPU machine's build (CUDA 13, its
glibc): run it there, e.g.

    python -m tools.isq_vs_llama_quantize --llama-cpp .peers/llama.cpp-cuda-sm90.tar.xz

or here with a CPU build of the same source (docs/BENCHMARKS.md, 2026-12-03, has the cmake lines):

    python -m tools.isq_vs_llama_quantize --llama-cpp LLAMA_CPP_SRC/b/bin --vocab 128256 --hidden 256 --layers 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ir.formats.gguf_file import GGUFFile
from ir.formats.gguf_quantize import quantize
from ir.formats.gguf_quants import dequantize
from tools import llama_cpp, synth_gguf

# llama-quantize's ftype name -> the one block type it writes with --pure.
FTYPES = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0", "Q2_K": "Q2_K",
          "Q3_K_S": "Q3_K", "Q4_K_S": "Q4_K", "Q5_K_S": "Q5_K", "Q6_K": "Q6_K"}


def compare(src: GGUFFile, out: GGUFFile, kind: str) -> tuple[int, int, float, float]:
    """(tensors compared, tensors whose bytes differ, worst relative dequantized difference, our seconds)."""
    compared = differ = 0
    worst = seconds = 0.0
    for name, t in out.tensors.items():
        if t.qtype != kind:
            continue
        s = src.tensors[name]
        values = dequantize(s.data, s.qtype, s.shape)
        start = time.perf_counter()
        ours = quantize(values, kind)
        seconds += time.perf_counter() - start
        theirs = np.ascontiguousarray(t.data).reshape(ours.shape)
        compared += 1
        rows = np.nonzero((ours != theirs).any(axis=1))[0]
        if rows.size:
            differ += 1
            diff = dequantize(ours, kind, s.shape) - dequantize(theirs, kind, s.shape)
            rel = float(np.sqrt(np.mean(diff**2)) / max(np.sqrt(np.mean(values**2)), 1e-30))
            worst = max(worst, rel)
            print(f"  {name}: {rows.size} of {ours.shape[0]} rows differ (first {rows[:5].tolist()}), dequantized "
                  f"RMS difference {rel:.2e} of the values' RMS")
    return compared, differ, worst, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, help="the binaries' folder or tarball (default: tools/llama_cpp's)")
    ap.add_argument("--vocab-file", type=Path, help="a vocab-only GGUF for the tokenizer metadata (default: "
                    "tools/synth_gguf's: .peers/, or extracted from llama.cpp's source tarball)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--types", default=",".join(FTYPES), help="llama-quantize types, comma-separated")
    synth_gguf.add_shape_args(ap)
    ap.set_defaults(vocab=1024, hidden=512, intermediate=1024, heads=8, kv_heads=4, head_dim=64, layers=2)
    args = ap.parse_args()
    lc = llama_cpp.locate(args.llama_cpp)
    shape = synth_gguf.shape_from_args(args)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        vocab = synth_gguf.find_vocab(args.vocab_file, Path(tmp))
        src_path = synth_gguf.write_model(Path(tmp) / "f16.gguf", shape, vocab, std=0.02, seed=0, progress=False)
        src = GGUFFile(src_path)
        for ftype in args.types.split(","):
            kind = FTYPES[ftype]
            dst = Path(tmp) / f"{ftype}.gguf"
            start = time.perf_counter()
            lc.run("llama-quantize", ["--pure", src_path, dst, ftype, args.threads], timeout=600)
            theirs_s = time.perf_counter() - start
            n, differ, worst, ours_s = compare(src, GGUFFile(dst), kind)
            failed += differ > 0 or n == 0
            verdict = "identical" if n and not differ else f"{differ} differ (worst {worst:.2e})" if n else "none"
            print(f"{ftype:7s} {kind}: {n} tensors, {verdict}; ours {ours_s:.2f} s, llama-quantize {theirs_s:.2f} s "
                  f"(whole file, {args.threads} threads)")
            dst.unlink()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
