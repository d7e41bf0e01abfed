"""Text form of a KernelIR, one op a line: `%7 = add %5, %6 : fp32[128]`."""

from __future__ import annotations

from .ir import Block, KernelIR, Op


def _attrs(op: Op) -> str:
    if op.opcode == "const":
        return f" {op.attrs['value']!r}"
    if not op.attrs:
        return ""
    return " {" + ", ".join(f"{k}={v}" for k, v in op.attrs.items()) + "}"


def _block(block: Block, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for op in block.ops:
        lhs = ", ".join(repr(r) for r in op.results)
        lhs = f"{lhs} = " if lhs else ""
        types = ", ".join(str(r.type) for r in op.results)
        if op.opcode == "for":
            lo, hi, *init = op.args
            iv, *carried = op.body.args
            carry = ", ".join(f"{c!r}={i!r}" for c, i in zip(carried, init, strict=True))
            stages = f" stages {op.attrs['stages']}" if op.attrs.get("stages") else ""
            lines.append(f"{pad}{lhs}for {iv!r} in range({lo!r}, {hi!r}, {op.attrs['step']}){stages} "
                         f"carry({carry}){' : ' + types if types else ''} {{")
            _block(op.body, depth + 1, lines)
            lines.append(f"{pad}  yield {', '.join(repr(y) for y in op.body.yields)}")
            lines.append(f"{pad}}}")
            continue
        args = " " + ", ".join(repr(a) for a in op.args) if op.args else ""
        lines.append(f"{pad}{lhs}{op.opcode}{args}{_attrs(op)}{' : ' + types if types else ''}")


def format_kernel(k: KernelIR) -> str:
    params = ", ".join(f"{p!r}: {p.type}" for p in k.params)
    consts = ", ".join(f"{n}={v!r}" for n, v in k.constexprs.items())
    lines = [f"kernel {k.name}({params})" + (f" [{consts}]" if consts else "") + " {"]
    _block(k.body, 1, lines)
    lines.append("}")
    return "\n".join(lines)
