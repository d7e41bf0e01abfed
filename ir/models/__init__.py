"""Architectures written once, found by HF `model_type` or GGUF `general.architecture`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ir.config import ModelConfig
from ir.graph import Graph


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    build: Callable[[ModelConfig, str], Graph]  # (config, compute dtype) -> graph
    hf_names: Callable[[ModelConfig], dict[str, str]]  # IR param -> HF tensor name
    gguf_names: Callable[[ModelConfig], dict[str, str]]  # IR param -> GGUF tensor name
    defaults: Mapping[str, Any] = field(default_factory=dict)  # config flags implied by the arch
    # llama.cpp's converter permutes q/k rows of these archs for ggml's interleaved rope.
    gguf_permuted_qk: bool = False


REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    REGISTRY[arch.name] = arch
    return arch


def _load_all() -> None:
    from ir.models import llama, qwen2, qwen3  # noqa: F401  (each registers itself)


def for_hf(model_type: str) -> Architecture:
    _load_all()
    for a in REGISTRY.values():
        if model_type in a.hf_model_types:
            return a
    known = sorted(t for a in REGISTRY.values() for t in a.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(known)}")


def for_gguf(general_arch: str) -> Architecture:
    _load_all()
    for a in REGISTRY.values():
        if general_arch in a.gguf_archs:
            return a
    known = sorted(t for a in REGISTRY.values() for t in a.gguf_archs)
    raise ValueError(f"unsupported GGUF architecture {general_arch!r}; supported: {', '.join(known)}")


def by_name(name: str) -> Architecture:
    _load_all()
    return REGISTRY[name]
