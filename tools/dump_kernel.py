#!/usr/bin/env python3
"""Print a DSL kernel's IR and generated source: `python -m tools.dump_kernel NAME [--target T] [--const K=V ...]`.

NAME is an entry of kernels_src/registry.py (`--list` shows them); constexprs and parameter types default to the
entry's realistic configuration. Targets come from EMITTERS: a new emitter plugs in with one line there.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Callable

from kernels_src.dsl import KernelIR, format_kernel


def _triton(k: KernelIR, num_warps: int) -> str:
    from kernels_src.dsl.triton_target import TritonRenderer

    return TritonRenderer().render(k)


def _ptx(k: KernelIR, num_warps: int) -> str:
    from kernels_src.dsl.triton_target import aot_compile

    return aot_compile(k, arch=90, num_warps=num_warps).asm["ptx"]


def _cubin(k: KernelIR, num_warps: int) -> bytes:
    from kernels_src.dsl.triton_target import aot_compile

    return aot_compile(k, arch=90, num_warps=num_warps, aligned=True).asm["cubin"]


def _sass(k: KernelIR, num_warps: int) -> str:
    from tools.sass_mix import sass

    return sass(_cubin(k, num_warps))


def _sass_mix(k: KernelIR, num_warps: int) -> str:
    from tools.sass_mix import loop_mix

    return loop_mix(_cubin(k, num_warps)).summary()


def _simt(target: str) -> Callable[[KernelIR, int], str]:
    def render(k: KernelIR, num_warps: int) -> str:
        from kernels_src.dsl.simt_targets import listing

        return listing(target, k, num_warps)

    return render


# target -> (render(kernel_ir, num_warps) -> text, printed by default)
EMITTERS: dict[str, tuple[Callable[[KernelIR, int], str], bool]] = {
    "ir": (lambda k, num_warps: format_kernel(k), True),
    "triton": (_triton, True),
    "ptx": (_ptx, False),  # Triton AOT for sm_90: needs triton, and TRITON_INTERPRET unset
    "sass": (_sass, False),  # the same build's SASS (16-byte aligned arguments, as the JIT specializes)
    "sass-mix": (_sass_mix, False),  # its main loop's instruction mix, registers and spills (tools/sass_mix.py)
    "metal": (_simt("metal"), False),  # the SIMT form as mx.fast.metal_kernel's header and body
    "cuda": (_simt("cuda"), False),  # the SIMT form as CUDA C for cupy.RawKernel
    "simt-cpu": (_simt("simt-cpu"), False),  # the SIMT form as the CPU oracle's C++
}


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string constexpr such as ACT=silu


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"dump_kernel: error: {what} takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    from kernels_src.registry import REGISTRY

    ap = argparse.ArgumentParser(prog="dump_kernel", description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="a registered kernel (see --list)")
    ap.add_argument("--target", action="append", choices=list(EMITTERS),
                    help="what to print (repeatable); default: " + ", ".join(t for t, (_, d) in EMITTERS.items() if d))
    ap.add_argument("--const", action="append", default=[], metavar="K=V", help="override a constexpr")
    ap.add_argument("--sig", action="append", default=[], metavar="P=TYPE", help='a parameter type, e.g. q="*fp16"')
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--list", action="store_true", help="list the registered kernels")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for name, e in REGISTRY.items():
            print(f"{name:24} {e.fn.__name__:28} {e.constexprs}")
        return 0 if args.list else 2
    if args.name not in REGISTRY:
        print(f"dump_kernel: error: no kernel {args.name!r} (known: {', '.join(REGISTRY)})", file=sys.stderr)
        return 2
    entry = REGISTRY[args.name]
    consts = {k: _value(v) for k, v in _pairs(args.const, "--const").items()}
    unknown = set(consts) - set(entry.constexprs)
    if unknown:
        print(f"dump_kernel: error: {sorted(unknown)} are not constexprs of {args.name} "
              f"({', '.join(entry.constexprs)})", file=sys.stderr)
        return 2
    k = entry.trace(signature=_pairs(args.sig, "--sig"), **consts)
    targets = args.target or [t for t, (_, default) in EMITTERS.items() if default]
    for i, target in enumerate(targets):
        if len(targets) > 1:
            print(("\n" if i else "") + f"# ---- {target}: {args.name} ----")
        print(EMITTERS[target][0](k, args.num_warps).rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
