"""What an engine is built from, and building it: the same for the engine process and the in-process modes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from frontend.engine.engine import EngineConfig, LLMEngine
from frontend.engine.gc_pauses import freeze_startup
from frontend.model_source import ModelNotFound
from ir.formats.errors import ModelFormatError

log = logging.getLogger("frontend")

# What a model that cannot be served raises while loading: reported as one line, never a traceback.
LOAD_ERRORS = (ModelNotFound, ModelFormatError, FileNotFoundError, ValueError, NotImplementedError, MemoryError)


@dataclass
class EngineSpec:
    model_path: str
    backend: str = "auto"
    backend_options: dict = field(default_factory=dict)
    config: EngineConfig = field(default_factory=EngineConfig)
    log_file: str | None = None  # the engine process logs there too (--log)
    isq: str | None = None  # --isq: quantize the matrices at load to this GGUF type, int4 or fp8 (ir.isq)
    task: str = "auto"  # --task: "embed" serves it for embeddings (ir.pooling), "auto" where its files say so

    def load(self) -> LLMEngine:
        """Loads the weights onto the backend and sizes the KV cache: only the engine's owner calls this."""
        from backends.base import create_backend
        from ir.loader import load_model

        model = load_model(self.model_path, progress=True, isq=self.isq, task=self.task)
        backend = create_backend(self.backend, model, **self.backend_options)
        engine = LLMEngine(backend, self.config)
        log.info("%s model on %s (%s); %s", model.arch.name, backend.name, backend.describe(),
                 backend.memory().line())
        freeze_startup()  # the loaded model's objects out of the collector's walks: no full-collection pauses in steps
        return engine
