#!/usr/bin/env python3
"""Print the IR graph and the parameter table of a model: `python -m tools.ir_dump [PATH]`.

PATH is a .gguf file or an HF safetensors folder; without it, the default SmolLM2 GGUF. The header says what the paged
KV cache holds per token (a latent's one tensor for MLA layers). `--fused` prints the graph the backends run:
ir.fusion's rewrite of it (weights concatenated where the file's formats agree).
"""

from __future__ import annotations

import argparse
import sys

from ir.default_model import default_model_path
from ir.formats.errors import ModelFormatError
from ir.fusion import fuse
from ir.kv_groups import kv_layout
from ir.loader import load_model
from ir.printer import format_graph, format_kv_layout, format_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ir_dump", description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", help="a .gguf file or a safetensors model folder")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"], help="compute dtype")
    ap.add_argument("--fused", action="store_true", help="the graph after the fusion pass")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--graph-only", action="store_true", help="print only the graph")
    part.add_argument("--params-only", action="store_true", help="print only the parameter table")
    args = ap.parse_args(argv)
    try:
        model = load_model(args.path or default_model_path(), dtype=args.dtype)
    except (ModelFormatError, FileNotFoundError, ValueError) as e:
        print(f"ir_dump: error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    print(f"# {model.path}\n# arch {model.arch.name} ({cfg.source_model_type}): {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, "
          f"vocab {cfg.vocab_size}, {cfg.rope}, weights {model.weights.nbytes / 2**20:.1f} MiB")
    print("\n".join(f"# {line}" for line in format_kv_layout(kv_layout(model.graph)).splitlines()))
    kinds, sources, graph = model.weights.kinds(), dict(model.sources), model.graph
    if args.fused:
        graph = fuse(graph, kinds)
        for p in graph.params.values():
            if p.parts:
                kinds[p.name] = kinds[p.parts[0]]
                sources[p.name] = " + ".join(sources.get(n, n) for n in p.parts)
    if not args.params_only:
        print(format_graph(graph))
    if not args.graph_only:
        print(format_params(graph, kinds, sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
