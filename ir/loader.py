"""Load a model (a GGUF file or an HF safetensors folder) into config + IR graph + weight store + tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ir import models
from ir.config import ModelConfig
from ir.formats import quant_checkpoints
from ir.formats.errors import ModelFormatError
from ir.formats.gguf_file import GGUFFile
from ir.formats.safetensors_file import read_safetensors, shard_files
from ir.graph import Graph
from ir.isq import isq_kind, quantize_weights
from ir.pooling import Pooling, gguf_pooling, read_pooling, task_of
from ir.weight_formats import FORMATS
from ir.weights import StoredTensor, WeightSource, WeightStore

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: Path
    arch: models.Architecture
    config: ModelConfig
    graph: Graph
    weights: WeightStore
    tokenizer: object | None  # ir.tokenizer.Tokenizer
    sources: dict[str, str]  # IR parameter -> tensor name in the file
    isq: str | None = None  # the --isq type its matrices were quantized to at load (another process loads it so)
    pooling: Pooling | None = None  # an embedding model: how its hidden states become a vector (ir.pooling)

    @property
    def task(self) -> str:
        """The --task that loads this model again so (a tensor-parallel rank's)."""
        return "embed" if self.pooling else "generate"


def load_model(path: str | Path, dtype: str = "f32", progress: bool = True, isq: str | None = None,
               task: str = "auto") -> LoadedModel:
    """`path` is a .gguf file or a folder with config.json and *.safetensors; `isq` ("q4k", ...) quantizes its
    matrices at load (ir.isq); `task` "embed" serves it for embeddings, "auto" where its files say so (ir.pooling)."""
    if isq is not None:
        isq_kind(isq)  # a bad type fails before the weights are read
    task = task_of(task)
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        return _load_hf_folder(path, dtype, progress, isq, task)
    return _load_gguf(path, dtype, progress, isq, task)


def synthetic_model(cfg: ModelConfig, dtype: str = "bf16") -> LoadedModel:
    """A model of `cfg`'s architecture and shape with no file and no weights: a benchmark's, whose backend makes
    random parameters (CUDABackend's random_weights; each tensor-parallel rank its own slice, from the same cfg)."""
    arch = models.by_name(cfg.arch)
    return LoadedModel(Path(f"synthetic-{cfg.arch}"), arch, cfg, arch.build(cfg, dtype), WeightStore(), None, {})


def load_tokenizer(path: str | Path):
    """The tokenizer (with its chat template) alone, no weight bound: what a process that serves HTTP needs."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        if not (path / "tokenizer.json").exists():
            return None
        from ir.tokenizer import Tokenizer

        return Tokenizer.from_dir(path)
    return _gguf_tokenizer(GGUFFile(path).metadata, path)


def _bind(arch: models.Architecture, cfg: ModelConfig, dtype: str, src: WeightSource, progress: bool,
          isq: str | None) -> tuple[Graph, WeightStore, dict[str, str]]:
    """The graph, and its parameters from the architecture's weight transform, each checked for its shape."""
    graph = arch.build(cfg, dtype)
    bar = tqdm(total=len(graph.params), desc=f"loading {src.path.name}", unit="tensor", disable=not progress,
               leave=False)
    src.on_fetch = lambda _name: bar.update(1)
    try:
        tensors = arch.load_weights(cfg, graph, src)
    finally:
        bar.close()
    store = WeightStore()
    for pname, p in graph.params.items():
        t = tensors.get(pname)
        if t is None:
            raise ModelFormatError(src.path, f"{arch.name}'s weights give no tensor for parameter {pname}")
        if tuple(t.shape) != p.shape:
            raise ModelFormatError(src.path, f"tensor {t.source!r} has shape {list(t.shape)}, "
                                   f"the config implies {list(p.shape)} (for parameter {pname})")
        store[pname] = t
    if isq is not None:
        quantize_weights(graph, store, isq, progress)
    return graph, store, {p: store[p].source for p in graph.params}


def _load_gguf(path: Path, dtype: str, progress: bool, isq: str | None, task: str) -> LoadedModel:
    f = GGUFFile(path)
    meta = f.metadata
    if "general.architecture" not in meta:
        raise ModelFormatError(path, "metadata has no general.architecture")
    arch = models.for_gguf(meta["general.architecture"], meta)
    freqs = f.tensors.get("rope_freqs.weight")
    factors = tuple(float(x) for x in StoredTensor(freqs.data, freqs.qtype, freqs.shape).dequantize()) \
        if freqs is not None else None

    def fetch(name: str) -> StoredTensor:
        t = f.tensors[name]
        return StoredTensor(t.data, t.qtype, t.shape, name)

    src = WeightSource("gguf", path, fetch, f.tensors)
    try:
        cfg = arch.config_from_gguf(meta, src, factors)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(path, f"metadata does not describe a {arch.name} model: {e}") from e
    pooling = gguf_pooling(meta, task)
    if pooling is not None:
        cfg = cfg.with_(pooled=True)
    graph, weights, sources = _bind(arch, cfg, dtype, src, progress, isq)
    _check_pooled(path, arch, graph, pooling)
    return LoadedModel(path, arch, cfg, graph, weights, _gguf_tokenizer(meta, path), sources, isq, pooling)


def _check_pooled(path: Path, arch: models.Architecture, graph: Graph, pooling: Pooling | None) -> None:
    if pooling is not None and graph.result != "hidden":
        raise NotImplementedError(f"{path}: {arch.name} cannot be served for embeddings yet (its graph has no "
                                  "head-less output; llama's decoder family has: llama, mistral, qwen2, qwen3, "
                                  "and their MoE variants)")


def _gguf_tokenizer(meta: Mapping, path: Path):
    if "tokenizer.ggml.tokens" not in meta:
        return None
    from ir.tokenizer import Tokenizer

    try:
        return Tokenizer.from_gguf_metadata(meta)
    except ValueError as e:
        log.warning("%s: no tokenizer: %s", path, e)
        return None


def _load_hf_folder(folder: Path, dtype: str, progress: bool, isq: str | None, task: str) -> LoadedModel:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelFormatError(folder, "no config.json: not a Hugging Face model folder")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(cfg_path, f"malformed JSON: {e}") from e
    arch = models.for_hf(str(hf.get("model_type", "")))
    try:
        cfg = arch.config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(cfg_path, f"config does not describe a {arch.name} model: {e}") from e
    pooling = read_pooling(folder, hf, task)
    if pooling is not None:
        cfg = cfg.with_(pooled=True)
    tensors = {}
    for shard in shard_files(folder):
        tensors.update(read_safetensors(shard))
    if pooling is not None and not any(k.startswith("model.") for k in tensors):
        # An embedding model saved as the bare decoder (Qwen3-Embedding: Qwen3Model's names, no "model.")
        tensors = {f"model.{k}": t for k, t in tensors.items()}
    qc = hf.get("quantization_config")
    scheme = quant_checkpoints.scheme_from_config(qc, cfg_path) if qc else None
    # A quantized linear's tensors (qweight, scales, weight_scale_inv, ...) are seen by the architecture as one
    # `<linear>.weight`.
    quantized = quant_checkpoints.linear_prefixes(tensors, scheme) if scheme else set()

    if not cfg.pooled and cfg.tie_word_embeddings is False and "lm_head.weight" not in tensors and \
            "lm_head" not in quantized:
        log.info("%s: no lm_head.weight; tying it to the embeddings", folder)
        cfg = cfg.with_(tie_word_embeddings=True)

    def fetch(name: str) -> StoredTensor:
        prefix = name.removesuffix(".weight")
        if prefix in quantized:
            return quant_checkpoints.read_linear(tensors, prefix, scheme, folder)
        t = tensors[name]
        fmt = FORMATS.get(t.dtype)
        if fmt is None or fmt.quantized:
            raise ModelFormatError(folder, f"tensor {name!r} has dtype {t.dtype}; expected a float type")
        return StoredTensor(t.data, t.dtype, t.shape, name)

    names = set(tensors) | {f"{p}.weight" for p in quantized}
    graph, weights, sources = _bind(arch, cfg, dtype, WeightSource("hf", folder, fetch, names), progress, isq)
    _check_pooled(folder, arch, graph, pooling)
    tok = None
    if (folder / "tokenizer.json").exists():
        from ir.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(folder)
    return LoadedModel(folder, arch, cfg, graph, weights, tok, sources, isq, pooling)


def dense_weights(model: LoadedModel) -> dict[str, np.ndarray]:
    """Every parameter dequantized to fp32 (for references and small models)."""
    return {k: t.dequantize() for k, t in model.weights.items()}
