"""llama.cpp as a benchmark peer: find (or unpack) the prebuilt CUDA binaries, run llama-quantize, llama-bench and
llama-batched-bench on a GGUF file, and parse their machine-readable output (llama-bench `-o jsonl`,
llama-batched-bench `--output-format jsonl`; its Markdown table too) into tok/s figures.

    python -m tools.llama_cpp unpack [TARBALL]      (once per machine: to /tmp/llama.cpp-cuda-sm90)
    python -m tools.llama_cpp bench MODEL.gguf      (pp2048 + tg128, flash attention on, all layers on the GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = "llama.cpp-cuda-sm90"
TARBALL = f"{BUILD}.tar.xz"
UNPACK_TO = Path("/tmp")
GPU_FLAGS = ["-ngl", "99"]  # every layer on the GPU
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q8_0")


@dataclass(frozen=True)
class BenchResult:
    """One llama-bench test: pp{n_prompt}, tg{n_gen}, each after n_depth tokens already in the context."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float  # tok/s, (n_prompt + n_gen) / time, averaged over the repetitions
    stddev_ts: float
    reps: int
    model_size: int  # bytes of the model's tensors, as llama.cpp counts them
    model_type: str
    gpu_info: str

    @property
    def test(self) -> str:
        name = f"pp{self.n_prompt}" if self.n_prompt and not self.n_gen else (
            f"tg{self.n_gen}" if self.n_gen and not self.n_prompt else f"pp{self.n_prompt}+tg{self.n_gen}")
        return name + (f" @ d{self.n_depth}" if self.n_depth else "")


@dataclass(frozen=True)
class BatchedResult:
    """One llama-batched-bench row: `pl` sequences of `pp` prompt tokens, then `tg` tokens each, decoded together."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    speed_pp: float  # prompt tok/s
    t_tg: float
    speed_tg: float  # decode tok/s over all sequences (S_TG)
    t: float
    speed: float


# --- parsing ----------------------------------------------------------------------------------------------------

def parse_bench(text: str) -> list[BenchResult]:
    """llama-bench's `-o json` (one array) or `-o jsonl` (one object a line) output."""
    s = text.strip()
    if not s:
        return []
    rows = json.loads(s, strict=False) if s.startswith("[") else [
        json.loads(line, strict=False) for line in s.splitlines() if line.startswith("{")]
    return [BenchResult(int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0)), float(r["avg_ts"]),
                        float(r["stddev_ts"]), len(r.get("samples_ns", ())), int(r["model_size"]),
                        str(r["model_type"]), str(r.get("gpu_info", ""))) for r in rows]


_BATCHED_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_BATCHED_TYPES = (int,) * 4 + (float,) * 6


def parse_batched(text: str) -> list[BatchedResult]:
    """llama-batched-bench's rows, from its `--output-format jsonl` lines or its Markdown table
    (`|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |`)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            out.append(BatchedResult(*(type_(r[k]) for type_, k in zip(_BATCHED_TYPES, _BATCHED_KEYS, strict=True))))
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) != len(_BATCHED_KEYS) or not cells[0].isdigit():
                continue  # the header and the |---| rule
            out.append(BatchedResult(*(type_(c) for type_, c in zip(_BATCHED_TYPES, cells, strict=True))))
    return out


# --- the binaries -----------------------------------------------------------------------------------------------

def tarball_candidates() -> list[Path]:
    env = os.environ.get("LLAMA_CPP_TARBALL")
    return ([Path(env)] if env else []) + [REPO / ".peers" / TARBALL, REPO.parent / "shared" / "peers" / TARBALL]


def unpack(tarball: Path, dest: Path = UNPACK_TO) -> Path:
    """Unpack once: a folder already holding llama-bench is kept."""
    folder = dest / BUILD
    if (folder / "llama-bench").is_file():
        return folder
    with tarfile.open(tarball, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    if not (folder / "llama-bench").is_file():
        raise FileNotFoundError(f"{tarball} did not unpack to {folder}/llama-bench")
    return folder


def locate(path: Path | None = None) -> LlamaCpp:
    """`path` (a folder with the binaries, or the tarball), else $LLAMA_CPP_DIR, else /tmp/llama.cpp-cuda-sm90
    (unpacked earlier), else the tarball from .peers/ or ../shared/peers, unpacked to /tmp."""
    if path is None and os.environ.get("LLAMA_CPP_DIR"):
        path = Path(os.environ["LLAMA_CPP_DIR"])
    if path is not None:
        return LlamaCpp(path if path.is_dir() else unpack(path))
    if (UNPACK_TO / BUILD / "llama-bench").is_file():
        return LlamaCpp(UNPACK_TO / BUILD)
    for t in tarball_candidates():
        if t.is_file():
            return LlamaCpp(unpack(t))
    raise FileNotFoundError(f"no llama.cpp: none of {UNPACK_TO / BUILD}, " + ", ".join(map(str, tarball_candidates()))
                            + " exists (copy the tarball into .peers/ and carry it with a run of its own)")


class LlamaCppError(RuntimeError):
    pass


class LlamaCpp:
    """The binaries of one build; every benchmark runs with all layers on the GPU and flash attention on."""

    def __init__(self, bindir: Path):
        self.bindir = Path(bindir)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{self.bindir}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(
            self.bindir)
        return env

    def run(self, tool: str, args: list[str], timeout: float) -> str:
        """stdout of `tool args`; a failure raises with the command and the tail of stderr."""
        cmd = [str(self.bindir / tool), *map(str, args)]
        try:
            p = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, errors="replace",
                               timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise LlamaCppError(f"{' '.join(cmd)}: no result after {timeout:.0f} s") from e
        if p.returncode != 0:
            raise LlamaCppError(f"{' '.join(cmd)}: exit {p.returncode}\n" + "\n".join(p.stderr.splitlines()[-15:]))
        return p.stdout

    def quantize(self, src: Path, dst: Path, qtype: str, threads: int = 16, timeout: float = 480) -> Path:
        """src (F16) -> dst in `qtype` (Q4_K_M, Q5_K_M, Q8_0 ...), written through a .part file."""
        tmp = dst.with_name(dst.name + ".part")
        self.run("llama-quantize", [src, tmp, qtype, threads], timeout)
        tmp.replace(dst)
        return dst

    def bench(self, model: Path, prompts: tuple[int, ...] = (2048,), gens: tuple[int, ...] = (128,),
              depths: tuple[int, ...] = (0,), reps: int = 3, ubatch: int = 512, timeout: float = 480
              ) -> list[BenchResult]:
        """llama-bench: pp{p} for each prompt and tg{g} for each gen, at each depth (0 = an empty context)."""
        args = ["-m", model, *GPU_FLAGS, "-fa", "1", "-p", _csv(prompts or (0,)), "-n", _csv(gens or (0,)),
                "-d", _csv(depths), "-r", reps, "-ub", ubatch, "-o", "jsonl"]
        return parse_bench(self.run("llama-bench", args, timeout))

    def batched_bench(self, model: Path, prompt: int, gen: int, batches: tuple[int, ...], shared_prompt: bool = False,
                      ubatch: int = 512, timeout: float = 480) -> list[BatchedResult]:
        """llama-batched-bench: for each batch B, B sequences of `prompt` tokens then `gen` decoded tokens each.
        The context holds every row (it skips, silently, a row that does not fit). `shared_prompt` (-pps) prefills
        one prompt and copies its KV to the other sequences' own cache streams: the decode reads as many bytes as
        with distinct prompts, the untimed part of the run is B times shorter."""
        ctx = max(batches) * (prompt + gen)
        args = ["-m", model, *GPU_FLAGS, "-fa", "on", "-c", ctx, "-b", 2048, "-ub", ubatch, "-npp", prompt,
                "-ntg", gen, "-npl", _csv(batches), "--output-format", "jsonl"] + (["-pps"] if shared_prompt else [])
        rows = parse_batched(self.run("llama-batched-bench", args, timeout))
        missing = set(batches) - {r.pl for r in rows}
        if missing:
            raise LlamaCppError(f"llama-batched-bench gave no row for batch {sorted(missing)} (context {ctx})")
        return rows


def _csv(xs) -> str:
    return ",".join(str(x) for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack", help=f"unpack the tarball to {UNPACK_TO / BUILD}")
    u.add_argument("tarball", type=Path, nargs="?")
    b = sub.add_parser("bench", help="llama-bench pp2048 + tg128 on a model")
    b.add_argument("model", type=Path)
    args = ap.parse_args()
    if args.cmd == "unpack":
        tar = args.tarball or next((t for t in tarball_candidates() if t.is_file()), None)
        if tar is None:
            raise SystemExit(f"no {TARBALL} in " + ", ".join(map(str, tarball_candidates())))
        print(unpack(tar))
    else:
        for r in locate().bench(args.model):
            print(f"{r.test:>16} {r.avg_ts:10.2f} ± {r.stddev_ts:.2f} tok/s  ({r.model_type}, {r.gpu_info})")


if __name__ == "__main__":
    main()
