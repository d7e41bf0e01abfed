"""tools/gpu_check.sh's steps are told apart by name (GPU_CHECK_STEPS picks them): a second shell function of one
name silently replaces the first for every later line, and a name used twice runs two steps for one request (two
`pending_moe` did: the second request timed the switches already decided, ~200 s of a 30-minute lease)."""

import re
from collections import Counter
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "gpu_check.sh"
FUNCTION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\(\) \{", re.M)
STEP = re.compile(r"(?:^|&& )step ([A-Za-z_][A-Za-z0-9_]*) (?:any|gpu2?) ", re.M)


def _twice(names: list[str]) -> list[str]:
    return sorted(n for n, c in Counter(names).items() if c > 1)


def test_functions_and_steps_are_named_once():
    text = SCRIPT.read_text()
    functions, steps = FUNCTION.findall(text), STEP.findall(text)
    assert len(functions) >= 5 and len(steps) >= 10  # the patterns read the script as it is written
    assert not _twice(functions), f"shell functions defined twice: {_twice(functions)}"
    assert not _twice(steps), f"steps named twice: {_twice(steps)}"


def test_the_patterns_catch_a_repeat():
    text = 'a() {\n}\na() {\n}\nstep x gpu 10 a\n[[ 1 ]] && step x gpu 5 a\n'
    assert _twice(FUNCTION.findall(text)) == ["a"]
    assert _twice(STEP.findall(text)) == ["x"]
