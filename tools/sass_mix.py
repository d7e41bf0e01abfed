"""The SASS of a Triton AOT build (sm_90 on a CPU: ptxas and cuobjdump ship in the triton wheel) and its instruction
mix inside the main loop, the proxy for a kernel's speed where no GPU is at hand: `tools/dump_kernel NAME --target
sass-mix` (or --target sass for the listing)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, *flags, path], capture_output=True, text=True, check=True).stdout


def sass(cubin: bytes) -> str:
    return _cuobjdump(cubin, "-sass")


@dataclass
class LoopMix:
    """The largest loop's instruction count and opcodes (predicates and modifiers dropped), and the resources."""
    instructions: int
    opcodes: collections.Counter
    registers: int
    stack: int

    def summary(self, top: int = 16) -> str:
        ops = ", ".join(f"{op} {n}" for op, n in self.opcodes.most_common(top))
        return f"main loop: {self.instructions} instructions ({ops}); {self.registers} registers, stack {self.stack}"


def loop_mix(cubin: bytes) -> LoopMix:
    """Counts between the target and the source of the backward branch spanning the most instructions."""
    return loops(cubin)[0]


def loops(cubin: bytes) -> list[LoopMix]:
    """Each backward branch's loop (its target to the branch; nested loops counted in their outer one too), the
    longest first: a kernel with two loops (a whole-tile one and a last-tile one) shows both."""
    instrs = [(int(a, 16), text.strip()) for a, text in _INSTR.findall(sass(cubin))]
    spans = sorted({(int(m.group(1), 16), addr) for addr, text in instrs
                    if (m := _BRANCH.search(text)) and int(m.group(1), 16) < addr}, key=lambda s: (s[0] - s[1], s[0]))
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    reg, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    out = []
    for lo, hi in spans or [(0, -1)]:
        body = [t for a, t in instrs if lo <= a <= hi]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        out.append(LoopMix(len(body), ops, reg, stack))
    return out
