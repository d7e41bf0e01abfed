"""Architectures written once, each a module of this package that declares `ARCH` (or `ARCHS`, several that share a
decoder): the HF `model_type`s and GGUF `general.architecture`s it answers to, its config class (the hyper-parameters
it knows, read from config.json or GGUF metadata), its graph builder and its weight transform. The registry finds
them by what each module declares; nothing here lists them."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ir.config import ModelConfig
from ir.graph import Graph
from ir.weights import StoredTensor, WeightSource

# (config, graph, the file's tensors) -> IR parameter -> tensor: renames, splits of fused tensors, stacking,
# permutations, per-source fix-ups; the loader then checks that every parameter came, in its shape.
LoadWeights = Callable[[ModelConfig, Graph, WeightSource], dict[str, StoredTensor]]


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    build: Callable[[ModelConfig, str], Graph]  # (config, compute dtype) -> graph
    load_weights: LoadWeights
    config_cls: type[ModelConfig] = ModelConfig  # from_hf / from_gguf
    defaults: Mapping[str, Any] = field(default_factory=dict)  # config flags implied by the arch
    # Claims a GGUF file of one of gguf_archs by its metadata (llama.cpp converts Mixtral as "llama" with an expert
    # count): an architecture that matches wins over one that has no test.
    gguf_match: Callable[[Mapping[str, Any]], bool] | None = None

    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        return self.config_cls.from_hf(hf, self.name, self.defaults)

    def config_from_gguf(self, meta: Mapping[str, Any], tensors, freq_factors=None) -> ModelConfig:
        return self.config_cls.from_gguf(meta, tensors, self.name, self.defaults, freq_factors)


def _discover() -> dict[str, Architecture]:
    found: dict[str, Architecture] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_"):
            continue
        m = importlib.import_module(f"{__name__}.{mod.name}")
        for arch in getattr(m, "ARCHS", ()) or ((m.ARCH,) if hasattr(m, "ARCH") else ()):
            if arch.name in found:
                raise RuntimeError(f"architecture {arch.name!r} declared twice ({mod.name})")
            found[arch.name] = arch
    return found


_REGISTRY: dict[str, Architecture] | None = None


def registry() -> dict[str, Architecture]:
    """name -> Architecture, every module of ir/models imported once."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _discover()
    return _REGISTRY


def for_hf(model_type: str) -> Architecture:
    for a in registry().values():
        if model_type in a.hf_model_types:
            return a
    known = sorted(t for a in registry().values() for t in a.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(known)}")


def for_gguf(general_arch: str, meta: Mapping[str, Any] | None = None) -> Architecture:
    candidates = [a for a in registry().values() if general_arch in a.gguf_archs]
    for a in sorted(candidates, key=lambda a: a.gguf_match is None):
        if a.gguf_match is None or (meta is not None and a.gguf_match(meta)):
            return a
    known = sorted(t for a in registry().values() for t in a.gguf_archs)
    raise ValueError(f"unsupported GGUF architecture {general_arch!r}; supported: {', '.join(known)}")


def by_name(name: str) -> Architecture:
    return registry()[name]
