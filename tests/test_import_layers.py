"""Imports point down the layers: frontend -> backends -> kernels_src, all over ir and core, never back up.

Every import of every module of those packages counts, wherever it sits (inside a function, under TYPE_CHECKING,
`importlib.import_module` of a literal name): a lazy import is still a dependency, only a hidden one. tools/ and
tests/ sit above every layer and may import anything; no layer may import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import only the packages before it.
LAYERS = ("core", "ir", "kernels_src", "backends", "frontend")
ABOVE_ALL = ("tools", "tests")


def module_name(path: str) -> tuple[str, bool]:
    """`backends/cuda/sampling.py` -> ("backends.cuda.sampling", False); a package's __init__ -> (its name, True)."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imports(source: str, path: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the file at `path` (relative to the repo root)."""
    module, is_package = module_name(path)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module))
                continue
            if node.level - 1 >= len(package):
                raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
            base = package[:len(package) - (node.level - 1)]
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif (isinstance(node, ast.Call) and _called(node.func) in ("import_module", "__import__") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _called(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def backward_imports(source: str, path: str) -> list[str]:
    """`path:line imports X` for each import of `source` that points up (or sideways into tools/tests)."""
    layer = Path(path).parts[0]
    allowed = LAYERS[:LAYERS.index(layer)]
    bad = []
    for line, name in imports(source, path):
        top = name.split(".")[0]
        if top != layer and ((top in LAYERS and top not in allowed) or top in ABOVE_ALL):
            may = ", ".join(allowed) or "none of " + ", ".join(LAYERS[1:])
            bad.append(f"{path}:{line} imports {name} ({layer} may import {may})")
    return bad


def layered_files() -> dict[str, list[Path]]:
    return {layer: sorted((ROOT / layer).rglob("*.py")) for layer in LAYERS}


def test_no_import_points_up_the_layers():
    files = layered_files()
    for layer, paths in files.items():
        assert paths, f"no Python files under {layer}/: the check would pass on nothing"
    bad = [b for paths in files.values() for f in paths
           for b in backward_imports(f.read_text(), f.relative_to(ROOT).as_posix())]
    assert not bad, "imports against the layers (frontend -> backends -> kernels_src -> ir -> core):\n" + "\n".join(bad)


def test_the_scan_sees_imports_the_repo_is_known_to_have():
    """The walk finds real imports of every kind, so a clean result means something."""
    def names(rel: str) -> set[str]:
        return {n for _, n in imports((ROOT / rel).read_text(), rel)}

    assert "core.sampler" in names("backends/cuda/sampling.py")
    assert "core.sampler" in names("backends/base.py")  # inside Backend.sample
    assert "backends.mlx.runtime" in names("backends/mlx/metal_kernel.py")
    assert "kernels_src.dsl.c_renderer" in names("kernels_src/dsl/metal_target.py")  # `from .c_renderer import`


@pytest.mark.parametrize("path,source,culprit", [
    ("kernels_src/dsl/metal_target.py", "def f():\n    from backends.mlx.runtime import mx\n", "backends.mlx.runtime"),
    ("backends/cuda/sampling.py", "import frontend.engine.sampler as s\n", "frontend.engine.sampler"),
    ("backends/base.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from frontend import LLM\n",
     "frontend"),
    ("ir/batch.py", "import numpy\nfrom kernels_src.dsl import tl\n", "kernels_src.dsl"),
    ("core/sampler.py", "from ir.batch import Batch\n", "ir.batch"),
    ("core/__init__.py", "import importlib\nimportlib.import_module('backends.base')\n", "backends.base"),
    ("frontend/cli.py", "from tools.bench_gpu import main\n", "tools.bench_gpu"),
])
def test_a_planted_backward_import_is_reported(path, source, culprit):
    bad = backward_imports(source, path)
    assert len(bad) == 1 and bad[0].startswith(f"{path}:") and f" imports {culprit} " in bad[0], bad


@pytest.mark.parametrize("path,source", [
    ("frontend/engine/engine.py", "from backends.base import Backend\nfrom core.sampler import Sampler\n"),
    ("backends/cuda/sampling.py", "from core.sampler import Sampler\nfrom kernels_src.dsl import tl\nimport torch\n"),
    ("ir/loader.py", "from core.sampling_params import SamplingParams\nfrom ir.formats import gguf_file\n"),
    ("core/sampler.py", "from .sampling_params import SamplingParams\nimport numpy as np\n"),
])
def test_imports_down_the_layers_pass(path, source):
    assert backward_imports(source, path) == []


def test_relative_imports_resolve_against_the_file():
    src = "from . import a\nfrom .b import c\nfrom .. import d\nfrom ..e.f import g\n"
    assert imports(src, "backends/cuda/x.py") == [(1, "backends.cuda"), (2, "backends.cuda.b"), (3, "backends"),
                                                  (4, "backends.e.f")]
    assert imports("from .sampler import Sampler\n", "core/__init__.py") == [(1, "core.sampler")]
    # From a package's __init__, `..` is the parent: backends/mlx/__init__.py -> backends.
    assert backward_imports("from ..x import y\n", "backends/mlx/__init__.py") == []
    with pytest.raises(ValueError, match="beyond the top-level"):
        imports("from .. import x\n", "core/sampler.py")
