"""A synthetic Llama-3-8B-shaped model (or, with --shape qwen3-30b-a3b, a Qwen3-MoE one: tools/synth_gguf_moe.py;
with --shape deepseek-v2-lite, a DeepSeek-V2-Lite one: tools/synth_gguf_deepseek.py) as a real F16 GGUF file that
llama.cpp and our loader both read: llama.cpp's tensor names and shapes, its metadata keys, and the tokenizer
metadata of a vocab-only GGUF (llama.cpp's models/ggml-vocab-llama-bpe.gguf) so that llama.cpp accepts the file.
Weights are random (std 0.02, norms 1), made on the GPU when there is one, and streamed to the file one tensor at a
time.

    python -m tools.synth_gguf OUT.gguf [--shape llama3-8b|qwen3-30b-a3b|deepseek-v2-lite] [--vocab-file VOCAB.gguf]
                               [--layers N] ...
"""

from __future__ import annotations

import argparse
import functools
import tarfile
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
from tqdm.auto import tqdm

from tools.synth_gguf_deepseek import DeepseekV2LiteShape
from tools.synth_gguf_moe import Qwen3MoEShape

REPO = Path(__file__).resolve().parents[1]
VOCAB_NAME = "ggml-vocab-llama-bpe.gguf"
VOCAB_MEMBER = f"llc/models/{VOCAB_NAME}"  # inside llama.cpp-src.tgz
SRC_TARBALL = "llama.cpp-src.tgz"


@dataclass(frozen=True)
class LlamaShape:
    """Hyper-parameters of the synthetic model; the defaults are Llama-3-8B's (context 32768)."""

    arch: ClassVar[str] = "llama"
    title: ClassVar[str] = "synthetic-llama3-8b-shape"

    vocab: int = 128256
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 32
    rope_theta: float = 500000.0
    context: int = 32768
    rms_eps: float = 1e-5

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape [rows, cols]) in the order llama.cpp's converter writes them. q/k rows are in
        llama.cpp's permuted order by definition: the values are random, so "permuted" is simply how every reader
        must take them."""
        return _llama_specs(self)

    def add_arch_metadata(self, w) -> None:
        """llama.cpp's keys for a llama model (what convert_hf_to_gguf.py writes for Llama-3-8B)."""
        w.add_context_length(self.context)
        w.add_embedding_length(self.hidden)
        w.add_block_count(self.layers)
        w.add_feed_forward_length(self.intermediate)
        w.add_head_count(self.heads)
        w.add_head_count_kv(self.kv_heads)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        w.add_rope_dimension_count(self.head_dim)
        w.add_rope_freq_base(self.rope_theta)
        w.add_layer_norm_rms_eps(self.rms_eps)
        w.add_vocab_size(self.vocab)


Shape = LlamaShape | Qwen3MoEShape | DeepseekV2LiteShape
# --shape's presets; bench_gguf names its files and results by these keys.
SHAPES: dict[str, Shape] = {"llama3-8b": LlamaShape(), "qwen3-30b-a3b": Qwen3MoEShape(),
                            "deepseek-v2-lite": DeepseekV2LiteShape()}


def tensor_specs(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The shape's tensors in writing order, each stored as `stored_dtype` says."""
    return s.tensor_specs()


def stored_dtype(name: str, shape: tuple[int, ...]) -> np.dtype:
    """F32 for 1-D tensors (norms) and a MoE's router, which convert_hf_to_gguf.py keeps in F32 (llama-quantize
    leaves both as they are); F16 for the rest."""
    return np.dtype(np.float32 if len(shape) == 1 or name.endswith("ffn_gate_inp.weight") else np.float16)


def _llama_specs(s: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (q, s.hidden)),
                (b + "attn_k.weight", (kv, s.hidden)), (b + "attn_v.weight", (kv, s.hidden)),
                (b + "attn_output.weight", (s.hidden, q)), (b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate.weight", (s.intermediate, s.hidden)), (b + "ffn_up.weight", (s.intermediate, s.hidden)),
                (b + "ffn_down.weight", (s.hidden, s.intermediate))]
    return out + [("output_norm.weight", (s.hidden,)), ("output.weight", (s.vocab, s.hidden))]


def file_bytes(s: Shape) -> int:
    """Tensor bytes of the F16 file (norms and routers F32)."""
    return sum(int(np.prod(shape)) * stored_dtype(name, shape).itemsize for name, shape in tensor_specs(s))


# --- the vocab-only GGUF ----------------------------------------------------------------------------------------

def vocab_candidates(cache: Path) -> list[Path]:
    return [REPO / ".peers" / VOCAB_NAME, cache / VOCAB_NAME]


def src_tarballs() -> list[Path]:
    """Where llama.cpp's source tarball may lie: the repo's ignored .peers/, or ../shared/peers beside the clone."""
    return [REPO / ".peers" / SRC_TARBALL, REPO.parent / "shared" / "peers" / SRC_TARBALL]


def find_vocab(explicit: Path | None = None, cache: Path = Path("/tmp/bench_gguf")) -> Path | None:
    """The vocab GGUF: `explicit`, else .peers/ or `cache`, else extracted from llama.cpp's source tarball into
    `cache`. None when none of them exists."""
    if explicit is not None:
        if not explicit.is_file():
            raise FileNotFoundError(f"{explicit}: no such vocab file")
        return explicit
    for p in vocab_candidates(cache):
        if p.is_file():
            return p
    for tgz in src_tarballs():
        if tgz.is_file():
            return extract_vocab(tgz, cache)
    return None


def extract_vocab(tgz: Path, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / VOCAB_NAME
    with tarfile.open(tgz, "r:gz") as tar:
        src = tar.extractfile(VOCAB_MEMBER)
        if src is None:
            raise FileNotFoundError(f"{tgz} has no {VOCAB_MEMBER}")
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(src.read())
        tmp.replace(dest)
    return dest


@functools.lru_cache(maxsize=2)
def tokenizer_metadata(vocab_file: Path) -> dict:
    """The file's tokenizer.* keys as Python values (read with our GGUF reader: gguf-py's takes ~6x longer; 128k
    tokens and 280k merges still take seconds, hence the cache). Not to be modified."""
    from ir.formats.gguf_file import GGUFFile

    return {k: v for k, v in GGUFFile(vocab_file).metadata.items() if k.startswith("tokenizer.")}


def _add_value(w, key: str, v) -> None:
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)  # token ids, as llama.cpp's converter writes them
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, list):
        w.add_array(key, v)  # strings stay strings; ints become INT32 (tokenizer.ggml.token_type's type)
    else:
        raise TypeError(f"metadata {key!r}: cannot copy a {type(v).__name__}")


def add_metadata(w, s: Shape, tok: dict) -> None:
    """The name, file type and the shape's architecture keys, then the vocab file's tokenizer keys."""
    import gguf

    w.add_name(s.title)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    s.add_arch_metadata(w)
    n_tok = len(tok.get("tokenizer.ggml.tokens", ()))
    if tok and n_tok != s.vocab:
        raise ValueError(f"the vocab file has {n_tok} tokens but --vocab is {s.vocab}: llama.cpp needs them equal")
    for k, v in tok.items():
        _add_value(w, k, v)


# --- random tensors ---------------------------------------------------------------------------------------------

class RandomTensors:
    """Seeded normal(0, std) matrices (F16, or F32 for a router) and all-ones F32 norms: torch on the GPU when there
    is one, else numpy."""

    def __init__(self, std: float, seed: int, device: str | None = None):
        self.std = std
        self.device = device or _default_device()
        if self.device == "cpu":
            self.rng = np.random.default_rng(seed)
        else:
            import torch

            self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype | type = np.float16) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        if self.device == "cpu":
            return (self.rng.standard_normal(shape, dtype=np.float32) * self.std).astype(dtype)
        import torch

        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float16).mul_(self.std)
        return t.cpu().numpy().astype(dtype, copy=False)


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


# --- the file ---------------------------------------------------------------------------------------------------

def write_model(path: Path, shape: Shape = LlamaShape(), vocab_file: Path | None = None, std: float = 0.02,
                seed: int = 0, device: str | None = None, progress: bool = True) -> Path:
    """Write the model to `path` (through a .part file, so a killed run leaves no file that looks complete)."""
    import gguf

    tok = tokenizer_metadata(vocab_file) if vocab_file is not None else {}
    specs = tensor_specs(shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    add_metadata(w, shape, tok)
    for name, shp in specs:
        dt = stored_dtype(name, shp)
        w.add_tensor_info(name, shp, dt, int(np.prod(shp)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fill = RandomTensors(std, seed, device)
    with tqdm(total=file_bytes(shape), unit="B", unit_scale=True, desc=f"writing {path.name}",
              disable=not progress) as bar:
        for name, shp in specs:  # the writer pops tensor infos in the order they were added
            arr = fill(shp, stored_dtype(name, shp))
            w.write_tensor_data(arr)
            bar.update(arr.nbytes)
    w.close()
    tmp.replace(path)
    return path


def shape_from_args(args: argparse.Namespace) -> Shape:
    """--shape's preset with the hyper-parameters given on the command line; one the preset lacks is an error."""
    preset = SHAPES[args.shape]
    known = {f.name for f in fields(preset)}
    given = {n: getattr(args, n) for n in _shape_fields() if getattr(args, n, None) is not None}
    unknown = sorted("--" + n.replace("_", "-") for n in set(given) - known)
    if unknown:
        raise SystemExit(f"--shape {args.shape} has no {', '.join(unknown)} (it takes {', '.join(sorted(known))})")
    return replace(preset, **given)


def _shape_fields() -> dict[str, type]:
    return {f.name: type(f.default) for s in SHAPES.values() for f in fields(s)}


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b", help="the preset the hyper-parameters "
                    "below change (default llama3-8b)")
    for name, kind in _shape_fields().items():
        defaults = ", ".join(f"{k} {getattr(s, name)}" for k, s in SHAPES.items() if hasattr(s, name))
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, help=f"(default: {defaults})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab-file", type=Path, help=f"a vocab-only GGUF (default: .peers/{VOCAB_NAME}, or extracted "
                    f"from {SRC_TARBALL} in .peers/ or ../shared/peers)")
    ap.add_argument("--no-vocab", action="store_true", help="write no tokenizer metadata (llama.cpp will refuse it)")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    add_shape_args(ap)
    args = ap.parse_args()
    vocab = None if args.no_vocab else find_vocab(args.vocab_file, args.out.parent)
    if vocab is None and not args.no_vocab:
        raise SystemExit(f"no vocab file: pass --vocab-file, put {VOCAB_NAME} in .peers/, or --no-vocab")
    shape = shape_from_args(args)
    write_model(args.out, shape, vocab, args.std, args.seed, args.device)
    print(f"{args.out}: {file_bytes(shape) / 1e9:.2f} GB of tensors, {shape}")


if __name__ == "__main__":
    main()
