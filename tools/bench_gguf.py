"""Our CUDA backend and llama.cpp on the same GGUF files, same GPU, same run: a synthetic Llama-3-8B written as F16
and quantized by llama.cpp to Q4_K_M, Q5_K_M and Q8_0; decode tok/s at several batch sizes and contexts, prefill
tok/s at 2048 tokens; each figure against the memory roofline and the other engine. `--shape qwen3-30b-a3b` does the
same for a Qwen3-MoE (tools/synth_gguf_moe.py: 16 of its 48 layers by default, F16 and Q4_K_M, decode and prefill),
its roofline counting only the routed experts' bytes; `--shape deepseek-v2-lite` for a DeepSeek-V2-Lite
(tools/synth_gguf_deepseek.py: MLA over its latent cache, 2 shared experts beside 64 routed ones, 12 of its 27
layers by default), the same plan, its roofline the routed experts' share, the rest of its weights and the latent
cache.

Stages, each resumable and short enough for one 10-minute call; products stay in --dir (default /tmp/bench_gguf)
and every figure is merged into DIR/results.json (results-SHAPE.json for a shape other than llama3-8b; the GGUF
files are named by shape too, so shapes share a --dir) with the time it was measured:

    python -m tools.bench_gguf --stage prepare  [--files f16,q4km]     write the F16 file, quantize
    python -m tools.bench_gguf --stage llamacpp [--files ...] [--what decode,prefill,curve] [--contexts ...]
    python -m tools.bench_gguf --stage ours     [--files ...] [--batches 1,16] ...
    python -m tools.bench_gguf --stage report                          table (Markdown, JSON) + plot; no GPU needed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from tools import synth_gguf

FILES = {"f16": ("f16", None), "q4km": ("q4_k_m", "Q4_K_M"), "q5km": ("q5_k_m", "Q5_K_M"), "q8_0": ("q8_0", "Q8_0")}
DEFAULT_SHAPE = "llama3-8b"
# What a shape measures unless --files / --what say otherwise: the MoE what issue 16 asks of it.
SHAPE_PLANS = {"llama3-8b": (tuple(FILES), ("decode", "prefill", "curve")),
               "qwen3-30b-a3b": (("f16", "q4km"), ("decode", "prefill")),
               "deepseek-v2-lite": (("f16", "q4km"), ("decode", "prefill"))}
DECODE_BATCHES = {"f16": (1, 16, 64, 256), "q4km": (1, 16, 64), "q5km": (1,), "q8_0": (1,)}
PREFILL_FILES = ("f16", "q4km")
CURVE_FILE, CURVE_BATCHES = "f16", (1, 16)
CONTEXTS = (128, 1024, 4096, 8192, 16384, 32768)
PROMPT, GEN, PREFILL = 128, 128, 2048
WHAT = ("decode", "prefill", "curve")


@dataclass(frozen=True)
class Figure:
    """decode: `batch` sequences with `context` tokens each in the cache, GEN more tokens timed; prefill: one prompt
    of `context` tokens."""

    file: str
    kind: str
    batch: int
    context: int

    @property
    def key(self) -> str:
        if self.kind == "prefill":
            return f"{self.file} prefill {self.context}"
        return f"{self.file} decode b{self.batch} c{self.context}"


def plan(files: list[str], what: list[str], batches: list[int] | None, contexts: list[int]) -> list[Figure]:
    """The figures asked for, each once, in the order they are measured."""
    out: list[Figure] = []
    for f in files:
        if "decode" in what:
            out += [Figure(f, "decode", b, PROMPT) for b in DECODE_BATCHES[f] if batches is None or b in batches]
        if "prefill" in what and f in PREFILL_FILES:
            out.append(Figure(f, "prefill", 1, PREFILL))
        if "curve" in what and f == CURVE_FILE:
            out += [Figure(f, "decode", b, c) for c in contexts for b in CURVE_BATCHES
                    if batches is None or b in batches]
    return list(dict.fromkeys(out))


def suffix(shape: str) -> str:
    """"" for the default shape (its files keep their old names), else "-SHAPE"."""
    return "" if shape == DEFAULT_SHAPE else f"-{shape}"


def gguf_name(shape: str, file: str) -> str:
    return f"{'model' if shape == DEFAULT_SHAPE else shape}-{FILES[file][0]}.gguf"


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def say(*a) -> None:
    print(*a, flush=True)


class Results:
    """DIR/results.json, merged across stages: figures[key] = {file, kind, batch, context, ours: {...},
    llamacpp: {...}}; files[name] = sizes; env; a log of stages and errors. Saved after every figure (a call cut off
    by its time limit keeps what it measured) and copied to `out` ($OUT: what comes back from the GPU machine)."""

    def __init__(self, path: Path, stage: str, out: Path | None = None):
        self.path, self.stage, self.out = path, stage, out
        self.data = json.loads(path.read_text()) if path.exists() else {}
        for k in ("figures", "files", "env"):
            self.data.setdefault(k, {})
        for k in ("stages", "errors"):
            self.data.setdefault(k, [])

    def put(self, fig: Figure, side: str, record: dict) -> None:
        entry = self.data["figures"].setdefault(fig.key, asdict(fig))
        entry[side] = {**record, "time": now(), "stage": self.stage}
        self.save()

    def error(self, what: str, err: Exception) -> None:
        say(f"  FAILED {what}: {err}")
        self.data["errors"].append({"stage": self.stage, "time": now(), "what": what, "error": str(err)[-2000:]})
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.path, self.out / self.path.name)


def file_info(path: Path) -> dict:
    """Bytes a decode step must read (every tensor but the embedding, of which it reads one row a token; of those,
    expert_bytes in routed expert stacks, of which a step reads the routed experts' share; all of them by part,
    tools.moe_bytes.tensor_part), KV bytes per token (f16, as both engines keep it: K and V, or MLA's one latent row),
    the tensor types, layers and experts."""
    from ir.formats.gguf_file import GGUFFile
    from tools.moe_bytes import ROUTED, tensor_part

    f = GGUFFile(path)
    m, arch = f.metadata, f.metadata["general.architecture"]
    kinds: dict[str, int] = {}
    parts: dict[str, int] = {}
    for n, t in f.tensors.items():
        kinds[t.qtype] = kinds.get(t.qtype, 0) + t.data.nbytes
        if n != "token_embd.weight" or "output.weight" not in f.tensors:
            parts[tensor_part(n)] = parts.get(tensor_part(n), 0) + t.data.nbytes
    heads, layers = int(m[f"{arch}.attention.head_count"]), int(m[f"{arch}.block_count"])
    kv_heads = int(m.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(m.get(f"{arch}.attention.key_length") or int(m[f"{arch}.embedding_length"]) // heads)
    # A file with the MLA widths (key_length_mla) caches [latent | rope key] (key_length wide) a token and layer,
    # its values a view of it: llama.cpp's K-only cache, our latent_attention's.
    mla = m.get(f"{arch}.attention.key_length_mla") is not None
    return {"path": str(path), "file_bytes": path.stat().st_size, "read_bytes": sum(parts.values()),
            "bytes_by_type": kinds, "bytes_by_part": parts,
            "kv_bytes_per_token": layers * head_dim * 2 if mla else layers * 2 * kv_heads * head_dim * 2,
            "layers": layers, "arch": arch, "expert_bytes": parts.get(ROUTED, 0),
            "experts": int(m.get(f"{arch}.expert_count") or 0), "top_k": int(m.get(f"{arch}.expert_used_count") or 0)}


class Stage:
    """What every stage shares: the figures asked for, the results file, a time budget."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.args, self.name = args, name
        self.dir: Path = args.dir
        self.results = Results(self.dir / f"results{suffix(args.shape)}.json", name, args.out)
        self.figures = plan(args.files, args.what, args.batches, args.contexts)
        self.deadline = time.monotonic() + args.budget

    def path(self, file: str) -> Path:
        return self.dir / gguf_name(self.args.shape, file)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def begin(self) -> None:
        # This run retries what failed before for these files: their old errors would only mislead the report.
        self.results.data["errors"] = [e for e in self.results.data["errors"] if e["stage"] != self.name
                                       or e["what"].split(":")[0] not in self.args.files]
        self.results.data["stages"].append({"stage": self.name, "started": now(), "argv": " ".join(
            sys.argv[1:])})
        self.results.data["env"]["shape"] = self.args.shape
        self.results.save()
        say(f"[{self.name}] {self.args.shape}: {len(self.figures)} figure(s) in {self.dir}, budget "
            f"{self.args.budget:.0f} s")

    def end(self) -> None:
        self.results.data["stages"][-1]["finished"] = now()
        self.results.save()

    def note_file(self, file: str) -> None:
        if self.path(file).exists():
            info = self.results.data["files"].setdefault(file, {})
            info.update(file_info(self.path(file)))
            self.results.save()


# --- prepare ----------------------------------------------------------------------------------------------------

def stage_prepare(args: argparse.Namespace) -> None:
    st = Stage(args, "prepare")
    st.begin()
    f16 = st.path("f16")
    shape = synth_gguf.shape_from_args(args)
    if f16.exists() and not args.force and file_info(f16)["layers"] != shape.layers:
        raise SystemExit(f"{f16} has {file_info(f16)['layers']} layers, not {shape.layers}: --force writes it again "
                         "(and quantizes again)")
    if args.force or not f16.exists():
        vocab = synth_gguf.find_vocab(args.vocab_file, st.dir)
        if vocab is None:
            raise SystemExit(f"no vocab file for llama.cpp: pass --vocab-file or put {synth_gguf.VOCAB_NAME} in "
                             f".peers/")
        t = time.perf_counter()
        synth_gguf.write_model(f16, shape, vocab)
        st.results.data["env"]["f16_write_s"] = time.perf_counter() - t
        say(f"  wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
    st.note_file("f16")
    for name in args.files:
        qtype = FILES[name][1]
        if qtype is None or (st.path(name).exists() and not args.force):
            st.note_file(name)
            continue
        from tools.llama_cpp import LlamaCppError, locate

        t = time.perf_counter()
        try:
            locate(args.llama_cpp).quantize(f16, st.path(name), qtype, args.threads, timeout=max(st.left(), 10))
        except LlamaCppError as e:
            st.results.error(f"{name}: llama-quantize {qtype}", e)
            continue
        st.results.data["env"][f"quantize_{name}_s"] = time.perf_counter() - t
        say(f"  {qtype}: {st.path(name)} ({st.path(name).stat().st_size / 1e9:.2f} GB) in "
            f"{time.perf_counter() - t:.0f} s")
        st.note_file(name)
    st.end()


def main() -> None:
    from tools.bench_gguf_report import stage_report
    from tools.bench_gguf_stages import stage_llamacpp, stage_ours

    args = parse_args()
    stages = {"prepare": stage_prepare, "llamacpp": stage_llamacpp, "ours": stage_ours, "report": stage_report}
    for name in (list(stages) if args.stage == "all" else [args.stage]):
        stages[name](args)


def _ints(s: str) -> list[int]:
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in s.split(",") if x]


def mmq_choice(text: str) -> tuple[str, int | None]:
    """--mmq VARIANT[:MAX_ROWS] as (variant, max rows or None)."""
    from kernels_src.gguf_mmq import VARIANTS

    variant, _, rows = text.partition(":")
    if variant not in VARIANTS or (rows and not (rows.isdigit() and 4 <= int(rows) <= 256)):
        raise argparse.ArgumentTypeError(f"{text!r}: VARIANT[:MAX_ROWS] with VARIANT one of {', '.join(VARIANTS)} "
                                         "and MAX_ROWS 4-256")
    return variant, int(rows) if rows else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True, choices=("prepare", "llamacpp", "ours", "report", "all"))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_gguf"), help="GGUF files and results.json")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="results.json and the report are copied here too (default: $OUT)")
    ap.add_argument("--files", help=f"of {', '.join(FILES)} (default: all for llama3-8b, f16,q4km for the MoE "
                    "shapes)")
    ap.add_argument("--what", help="decode (batch sizes at a 128-token context), prefill "
                    f"({PREFILL} tokens), curve (decode against context, {CURVE_FILE} only); default: all three for "
                    "llama3-8b, decode,prefill for the MoE shapes")
    ap.add_argument("--batches", help="only these batch sizes (default: every planned one)")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="the curve's contexts (1k = 1024)")
    ap.add_argument("--budget", type=float, default=540, help="seconds this stage may take: work that would start "
                    "later is skipped (and says so)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"), help="ours: the KV cache's "
                    "elements (int8: 1.125 bytes each; fp8: e4m3, 1 + 4 / head_dim; results.json merges by figure: "
                    "give each run its own --out)")
    ap.add_argument("--mmq", type=mmq_choice, default=None, metavar="VARIANT[:MAX_ROWS]",
                    help="ours: the Q4_K / Q6_K int8 GEMM's variant (per32 or per256) and the most rows it takes "
                    "(default: the runner's); give each run its own --out")
    ap.add_argument("--force", action="store_true", help="prepare: write and quantize again even if files exist")
    ap.add_argument("--vocab-file", type=Path)
    ap.add_argument("--llama-cpp", type=Path, help="folder of llama.cpp binaries or its tarball")
    ap.add_argument("--threads", type=int, default=16, help="llama-quantize threads")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--no-shared-prompt", action="store_true", help="llama.cpp curve: prefill every sequence's "
                    "prompt instead of one copied to each sequence's own cache (-pps)")
    synth_gguf.add_shape_args(ap)
    args = ap.parse_args(argv)
    files, what = SHAPE_PLANS[args.shape]
    args.files = [f for f in (args.files or ",".join(files)).split(",") if f]
    bad = set(args.files) - set(FILES)
    if bad:
        ap.error(f"unknown --files {sorted(bad)}; known: {', '.join(FILES)}")
    args.what = [w for w in (args.what or ",".join(what)).split(",") if w]
    if set(args.what) - set(WHAT):
        ap.error(f"--what takes {', '.join(WHAT)}")
    args.batches = _ints(args.batches) if args.batches else None
    args.contexts = _ints(args.contexts)
    return args


if __name__ == "__main__":
    main()
