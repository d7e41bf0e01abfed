"""Where the model comes from: --w (folder), --f (GGUF file), --m (hub id or local path; with --f, a file
in that repo), or the default SmolLM2. Hub ids resolve through huggingface_hub's cache first, so a cached
model loads offline; otherwise they are downloaded, with huggingface_hub's own progress bars."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ir.default_model import FILENAME as DEFAULT_FILE
from ir.default_model import default_model_path

DEFAULT_ID = "SmolLM2-135M-Instruct"
# What a safetensors model folder needs; GGUF repos are read one file at a time (--f).
HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class ModelNotFound(Exception):
    """The model is neither on disk nor reachable; the message says what was tried."""


@dataclass
class ModelSource:
    path: Path  # a .gguf file or a folder
    id: str  # what /v1/models calls it


def resolve(weights: str | None = None, file: str | None = None, model: str | None = None) -> ModelSource:
    if weights:
        return ModelSource(_existing(Path(weights)), Path(weights).name)
    if model:
        local = Path(model).expanduser()
        if local.exists():
            path = local / file if file else local
            return ModelSource(_existing(path), model)
        return ModelSource(hub_path(model, file), model)
    if file:
        return ModelSource(_existing(Path(file)), Path(file).stem)
    path = default_model_path()
    return ModelSource(path, DEFAULT_ID if path.name == DEFAULT_FILE else path.stem)


def _existing(path: Path) -> Path:
    path = path.expanduser()
    if not path.exists():
        raise ModelNotFound(f"{path}: no such file or folder")
    return path


def hub_path(repo_id: str, filename: str | None = None) -> Path:
    """The local path of a hub model (one file with `filename`), from the cache or downloaded."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    def fetch(local_only: bool) -> Path:
        if filename:
            return Path(hf_hub_download(repo_id, filename, local_files_only=local_only))
        return Path(snapshot_download(repo_id, allow_patterns=HF_PATTERNS, local_files_only=local_only))

    what = f"{repo_id}/{filename}" if filename else repo_id
    try:
        path = fetch(local_only=True)
    except (LocalEntryNotFoundError, EntryNotFoundError, FileNotFoundError):
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(f"{what} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                                "HF_HUB_OFFLINE is set, so the hub was not asked") from None
        try:
            path = fetch(local_only=False)
        except RepositoryNotFoundError:
            raise ModelNotFound(f"{repo_id}: no such model on the hub (or it is private: set HF_TOKEN)") from None
        except EntryNotFoundError as e:
            if filename and not isinstance(e, LocalEntryNotFoundError):  # the local kind means: no connection
                raise ModelNotFound(f"{repo_id} has no file {filename!r}") from None
            raise ModelNotFound(f"{what} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                                f"the hub could not be reached ({_first_line(e)})") from None
        except Exception as e:  # connection refused, DNS, proxy, ...: the hub is unreachable
            raise ModelNotFound(f"{what} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                                f"hub could not be reached ({e.__class__.__name__}: {_first_line(e)})") from None
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files: choose one with --f ({', '.join(ggufs)})" if ggufs else \
            "; for a GGUF repo, name the file with --f"
        raise ModelNotFound(f"{repo_id} has no config.json{hint}")
    return path


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""

