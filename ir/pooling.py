"""Whether a model is served for embeddings, and how its hidden states are pooled: read from sentence-transformers'
`modules.json` + `1_Pooling/config.json` (and a Normalize module), a GGUF file's pooling_type, or asked for (--task
embed); Matryoshka dimensions as the HF config declares them (`is_matryoshka`, `matryoshka_dimensions`, as vLLM)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ir.formats.errors import ModelFormatError

TASKS = ("auto", "generate", "embed")  # --task; vLLM's --runner spells them auto / generate / pooling
RUNNER_TASKS = {"auto": "auto", "generate": "generate", "pooling": "embed"}
MODES = ("last", "mean", "cls")
# sentence-transformers' pooling_mode_* keys we run, and those we refuse by name
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    """How a step's final-norm hidden states become one vector a request."""

    mode: str  # "last" token, "mean" over the input's tokens, or "cls" (its first token)
    normalize: bool  # L2-normalized (a Normalize module; the default where none is configured)
    dims: int  # the hidden size: the vector's length
    matryoshka: bool = False  # `dimensions` may truncate the vector (then it is renormalized)
    matryoshka_dims: tuple[int, ...] = ()  # the only sizes allowed, where the config lists them

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(MODES)}, not {self.mode!r}")

    def check_dimensions(self, dimensions: int) -> None:
        """Raises ValueError naming what this model allows for OpenAI's `dimensions`."""
        if not self.matryoshka:
            raise ValueError(f"this model does not support dimensions (not a Matryoshka model); its embeddings have "
                             f"{self.dims}")
        if self.matryoshka_dims and dimensions not in self.matryoshka_dims:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dims)}, got {dimensions}")
        if not 1 <= dimensions <= self.dims:
            raise ValueError(f"dimensions must be between 1 and {self.dims}, got {dimensions}")


def task_of(task: str) -> str:
    """--task or vLLM's --runner spelling -> "auto", "generate" or "embed"; anything else is refused."""
    if task in TASKS:
        return task
    if task in RUNNER_TASKS:
        return RUNNER_TASKS[task]
    raise ValueError(f"--task must be one of {', '.join(TASKS)} (or vLLM's --runner {', '.join(RUNNER_TASKS)}), "
                     f"not {task!r}")


def read_pooling(folder: Path, hf: Mapping[str, Any], task: str = "auto") -> Pooling | None:
    """The folder's pooling, or None where it is served for generation. "auto": an embedding model when its
    sentence-transformers files say so; "embed" without them: last token, normalized (Qwen3-Embedding's)."""
    task = task_of(task)
    if task == "generate":
        return None
    hidden = int(hf["hidden_size"])
    dims = hf.get("matryoshka_dimensions")
    matryoshka = dict(matryoshka=bool(hf.get("is_matryoshka")) or bool(dims),
                      matryoshka_dims=tuple(sorted(int(d) for d in dims or ())))
    modules = _modules(folder)
    if modules is None:
        return Pooling("last", True, hidden, **matryoshka) if task == "embed" else None
    types = [str(m.get("type", "")) for m in modules]
    pool = next((m for m in modules if m.get("type") == _ST + "Pooling"), None)
    if pool is None:
        return Pooling("last", True, hidden, **matryoshka) if task == "embed" else None
    extra = [t for t in types if t.startswith(_ST) and t.removeprefix(_ST) not in ("Transformer", "Pooling",
                                                                                   "Normalize")]
    if extra:
        raise NotImplementedError(f"{folder}: sentence-transformers module {extra[0]} is not supported (only "
                                  "Transformer, Pooling and Normalize)")
    return Pooling(_mode(folder / str(pool.get("path", "1_Pooling")) / "config.json"), _ST + "Normalize" in types,
                   hidden, **matryoshka)


_GGUF_MODES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's pooling_type (0 none, 4 rank)


def gguf_pooling(meta: Mapping[str, Any], task: str = "auto") -> Pooling | None:
    """A GGUF file's pooling: its `{arch}.pooling_type` (llama.cpp's embedding models carry it; their vectors are
    normalized, as llama-server's are by default), or last token with --task embed where it has none."""
    task = task_of(task)
    if task == "generate":
        return None
    arch = meta["general.architecture"]
    hidden = int(meta[f"{arch}.embedding_length"])
    kind = int(meta.get(f"{arch}.pooling_type", 0))
    if kind == 0:
        return Pooling("last", True, hidden) if task == "embed" else None
    if kind not in _GGUF_MODES:
        raise NotImplementedError(f"GGUF {arch}.pooling_type {kind} (rank) is not supported; pooling types: "
                                  + ", ".join(f"{k} ({m})" for k, m in _GGUF_MODES.items()))
    return Pooling(_GGUF_MODES[kind], True, hidden)


def _modules(folder: Path) -> list[dict] | None:
    path = folder / "modules.json"
    if not path.exists():
        return None
    try:
        modules = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(path, f"malformed JSON: {e}") from e
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelFormatError(path, "expected a list of modules")
    return modules


def _mode(path: Path) -> str:
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(path, "modules.json names a Pooling module whose config.json is missing") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(path, f"malformed JSON: {e}") from e
    refused = [k for k in _ST_UNSUPPORTED if cfg.get(k)]
    if refused:
        raise NotImplementedError(f"{path}: {refused[0]} is not supported (pooling modes: "
                                  f"{', '.join(_ST_MODES)})")
    modes = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise ModelFormatError(path, f"expected exactly one of {', '.join(_ST_MODES)} set, found {len(modes)}")
    return modes[0]
