"""One error type for every unreadable model file: its message is one line naming file and problem."""

from __future__ import annotations

from pathlib import Path


class ModelFormatError(ValueError):
    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")
