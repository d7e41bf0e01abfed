"""The engine and its OpenAI server. `from frontend import LLM, SamplingParams`, as with vLLM."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `python -m frontend` and the server import this package without loading a backend.
    if name == "LLM":
        from frontend.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from core.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'frontend' has no attribute {name!r}")
