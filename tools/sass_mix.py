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
    instrs = [(int(a, 16), text.strip()) for a, text in _INSTR.findall(sass(cubin))]
    span = (0, -1)
    for addr, text in instrs:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > span[1] - span[0]:
            span = (int(m.group(1), 16), addr)
    body = [t for a, t in instrs if span[0] <= a <= span[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    reg, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    return LoopMix(len(body), ops, reg, stack)
