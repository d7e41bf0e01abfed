"""Load a model (a GGUF file or an HF safetensors folder) into config + IR graph + weight store + tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ir import config as configs
from ir import models
from ir.config import ModelConfig
from ir.formats.errors import ModelFormatError
from ir.formats.gguf_file import GGUFFile
from ir.formats.safetensors_file import read_safetensors, shard_files
from ir.graph import Graph
from ir.weights import StoredTensor, WeightStore, rope_unpermute_rows

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


def load_model(path: str | Path, dtype: str = "f32", progress: bool = True) -> LoadedModel:
    """`path` is a .gguf file or a folder with config.json and *.safetensors."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        return _load_hf_folder(path, dtype, progress)
    return _load_gguf(path, dtype, progress)


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


def _bind(graph: Graph, names: Mapping[str, str], fetch: Callable[[str], StoredTensor | None],
          path: Path, progress: bool) -> WeightStore:
    store = WeightStore()
    for pname, p in tqdm(graph.params.items(), desc=f"loading {path.name}", unit="tensor",
                         disable=not progress, leave=False):
        src = names.get(pname, pname)
        t = fetch(src)
        if t is None:
            raise ModelFormatError(path, f"missing tensor {src!r} (for parameter {pname})")
        if tuple(t.shape) != p.shape:
            raise ModelFormatError(path, f"tensor {src!r} has shape {list(t.shape)}, "
                                   f"the config implies {list(p.shape)}")
        store[pname] = t
    return store


_GGUF_OPTIONAL = {"qkv_bias": "blk.0.attn_q.bias", "o_bias": "blk.0.attn_output.bias",
                  "mlp_bias": "blk.0.ffn_up.bias", "qk_norm": "blk.0.attn_q_norm.weight"}


def _load_gguf(path: Path, dtype: str, progress: bool) -> LoadedModel:
    f = GGUFFile(path)
    meta = f.metadata
    if "general.architecture" not in meta:
        raise ModelFormatError(path, "metadata has no general.architecture")
    arch = models.for_gguf(meta["general.architecture"])
    freqs = f.tensors.get("rope_freqs.weight")
    factors = tuple(float(x) for x in StoredTensor(freqs.data, freqs.qtype, freqs.shape).dequantize()) \
        if freqs is not None else None
    # GGUF metadata has no bias or norm flags: the tensors present are the description.
    present = {flag: True for flag, name in _GGUF_OPTIONAL.items() if name in f.tensors}
    try:
        cfg = configs.from_gguf(meta, arch.name, {**arch.defaults, **present},
                                tied="output.weight" not in f.tensors, freq_factors=factors)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(path, f"metadata does not describe a {arch.name} model: {e}") from e
    graph = arch.build(cfg, dtype)
    names = arch.gguf_names(cfg)
    heads = {"attn_q.": cfg.num_heads, "attn_k.": cfg.num_kv_heads}

    def fetch(name: str) -> StoredTensor | None:
        t = f.tensors.get(name)
        if t is None:
            return None
        st = StoredTensor(t.data, t.qtype, t.shape, name)
        n_heads = next((h for k, h in heads.items() if k in name), None)
        if arch.gguf_permuted_qk and n_heads:
            st = st.permute_rows(rope_unpermute_rows(t.shape[0], n_heads))
        return st

    weights = _bind(graph, names, fetch, path, progress)
    return LoadedModel(path, arch, cfg, graph, weights, _gguf_tokenizer(meta, path),
                       {p: names.get(p, p) for p in graph.params})


def _gguf_tokenizer(meta: Mapping, path: Path):
    if "tokenizer.ggml.tokens" not in meta:
        return None
    from ir.tokenizer import Tokenizer

    try:
        return Tokenizer.from_gguf_metadata(meta)
    except ValueError as e:
        log.warning("%s: no tokenizer: %s", path, e)
        return None


def _load_hf_folder(folder: Path, dtype: str, progress: bool) -> LoadedModel:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelFormatError(folder, "no config.json: not a Hugging Face model folder")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(cfg_path, f"malformed JSON: {e}") from e
    arch = models.for_hf(str(hf.get("model_type", "")))
    try:
        cfg = configs.from_hf(hf, arch.name, arch.defaults)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(cfg_path, f"config does not describe a {arch.name} model: {e}") from e
    tensors = {}
    for shard in shard_files(folder):
        tensors.update(read_safetensors(shard))
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in tensors:
        log.info("%s: no lm_head.weight; tying it to the embeddings", folder)
        cfg = cfg.with_(tie_word_embeddings=True)
    graph = arch.build(cfg, dtype)
    names = arch.hf_names(cfg)

    def fetch(name: str) -> StoredTensor | None:
        t = tensors.get(name)
        if t is None:
            return None
        if t.dtype not in ("F32", "F16", "BF16"):
            raise ModelFormatError(folder, f"tensor {name!r} has dtype {t.dtype}; expected a float type")
        return StoredTensor(t.data, t.dtype, t.shape, name)

    weights = _bind(graph, names, fetch, folder, progress)
    tok = None
    if (folder / "tokenizer.json").exists():
        from ir.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(folder)
    return LoadedModel(folder, arch, cfg, graph, weights, tok, {p: names.get(p, p) for p in graph.params})


def dense_weights(model: LoadedModel) -> dict[str, np.ndarray]:
    """Every parameter dequantized to fp32 (for references and small models)."""
    return {k: t.dequantize() for k, t in model.weights.items()}
