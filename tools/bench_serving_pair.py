"""Our server and llama-server on one GGUF file, in one call: the same streamed load (tools/bench_serving) on each,
ours with the offline engine's rate for the same prompts beside it; one table and the plots of all three.

    python -m tools.bench_serving_pair --gguf /tmp/bench_gguf/model-f16.gguf --concurrency 1,16,64,256 \\
        --num-prompts 8,32,128,256 [--out DIR] [--client-procs 4]
    python -m tools.bench_serving_pair --plot DIR/serving_pair.json      (the plots again, e.g. on a machine
                                                                          with matplotlib)

Our server runs `python -m frontend --backend cuda` with --max-num-seqs the largest concurrency and no prefix cache
(every level draws new prompts anyway); llama-server (../shared/peers, found as tools/llama_cpp does) runs with
all layers on the GPU, flash attention, one slot per stream of the largest concurrency (-np) and a context of
np x (input + output + 32) tokens. Each server is stopped before the next starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tools import bench_serving
from tools.bench_serving_report import write_json

REPO = Path(__file__).resolve().parents[1]


class Served:
    """A server process on 127.0.0.1:port, up once GET /health answers 200; stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None, startup_s: float = 600):
        self.name, self.cmd, self.port, self.env, self.startup_s = name, cmd, port, env, startup_s
        self.base = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Served:
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{self.name}-", suffix=".log", delete=False)
        t = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        while time.perf_counter() - t < self.startup_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.startup = time.perf_counter() - t
                        print(f"{self.name} up in {self.startup:.0f} s", flush=True)
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"{self.name} did not answer /health in {self.startup_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if exc and exc[0] is not None:
            print(f"--- {self.name}'s log, last lines:\n{self.tail()}", flush=True)


SCHEDULER_FLAGS = ("decode_step_tokens", "prefill_spread_steps", "max_num_batched_tokens", "prefill_burst_tokens")


def scheduler_flags(a: argparse.Namespace, prefix: str) -> list[str]:
    """The scheduler settings given (None: the engine's own), as our server's flags (prefix "--") or
    bench_serving's for its offline engine ("--offline-")."""
    out = []
    for name in SCHEDULER_FLAGS:
        if getattr(a, name) is not None:
            out += [prefix + name.replace("_", "-"), str(getattr(a, name))]
    return out


def load_args(a: argparse.Namespace, base: str, result: Path, offline: bool) -> list[str]:
    argv = ["--base-url", base, "--concurrency", a.concurrency, "--num-prompts", a.num_prompts,
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--tokenizer", str(a.gguf),
            "--client-procs", str(a.client_procs), "--result-file", str(result), "--no-plot", "--disable-tqdm"]
    if offline:
        argv += ["--offline", "--offline-model", str(a.gguf), "--offline-backend", a.backend,
                 "--offline-mem", str(a.mem)]
        argv += scheduler_flags(a, "--offline-")  # the offline engine schedules as our server does
    return argv


def run(a: argparse.Namespace) -> dict:
    a.out.mkdir(parents=True, exist_ok=True)
    parts = a.out / "parts"  # each side's own JSON (serving_pair.json holds both), kept should a later part fail
    parts.mkdir(exist_ok=True)
    top = max(int(c) for c in a.concurrency.split(","))
    ours_cmd = [sys.executable, "-m", "frontend", "--f", str(a.gguf), "--backend", a.backend, "--h", "127.0.0.1",
                "--p", str(a.port), "--max-num-seqs", str(top), "--mem", str(a.mem), "--disable-prefix-cache"]
    ours_cmd += scheduler_flags(a, "--")
    pair = {"gguf": str(a.gguf), "concurrency": a.concurrency, "num_prompts": a.num_prompts,
            "input_len": a.input_len, "output_len": a.output_len, "ours_cmd": ours_cmd[1:]}
    with Served("ours", ours_cmd, a.port) as s:
        pair["ours"] = bench_serving.main(load_args(a, s.base, parts / "ours.json", offline=True))
        pair["ours_startup_s"] = s.startup
        if a.long_prompts:
            pair["long"] = long_prompts(a, s, parts)
        s.log.flush()
        (a.out / "ours_server.log").write_text(Path(s.log.name).read_text(errors="replace")[-200_000:])
    write_json(pair, a.out / "serving_pair.json")  # kept should the peer fail
    if not a.no_peer:  # --no-peer: a check of the tool itself (tests, a CPU machine), no figure to record
        try:
            pair["llama"] = run_peer(a, top, parts)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - ours is measured: report it, and why the peer is not
            pair["llama_error"] = f"{e.__class__.__name__}: {e}"
            print(f"llama-server: {pair['llama_error']}")
        write_json(pair, a.out / "serving_pair.json")
    print_table(pair)
    try:
        for path in plot_pair(pair, a.out / "serving_pair"):
            print(f"plot: {path}")
    except ImportError as e:  # the GPU machine may lack matplotlib: --plot the JSON elsewhere
        print(f"no plots ({e})")
    return pair


def long_prompts(a: argparse.Namespace, s: Served, parts: Path) -> list[dict]:
    """One streamed request per --long-prompts length, alone on our server (each prompt past the start-up decode
    graphs' contexts), then /health: what a long prompt costs and that the server is still up after it."""
    out = []
    for n in map(int, a.long_prompts.split(",")):
        argv = ["--base-url", s.base, "--concurrency", "1", "--num-prompts", "1", "--input-len", str(n),
                "--output-len", str(a.long_output_len), "--tokenizer", str(a.gguf), "--result-file",
                str(parts / f"long-{n}.json"), "--no-plot", "--disable-tqdm"]
        m = bench_serving.main(argv)["levels"][0]["metrics"]
        with urllib.request.urlopen(s.base + "/health", timeout=10) as r:
            healthy = r.status == 200
        out.append({"prompt": n, "output": a.long_output_len, "ttft_ms": m["ttft_ms"]["median"],
                    "itl_ms": m["itl_ms"]["median"], "decode_tok_s": 1e3 / m["tpot_ms"]["mean"],
                    "failed": m["failed"], "errors": m.get("errors", [])[:2], "healthy_after": healthy})
        print(f"long prompt {n}: TTFT {out[-1]['ttft_ms']:,.0f} ms, ITL p50 {out[-1]['itl_ms']:.1f} ms, "
              f"{out[-1]['decode_tok_s']:,.0f} tok/s decoding, failed {m['failed']}, /health "
              f"{'200' if healthy else 'not 200'}", flush=True)
    return out


def run_peer(a: argparse.Namespace, top: int, parts: Path) -> dict:
    from tools.llama_cpp import locate

    llama = locate(a.llama_cpp)
    np_ = a.llama_np or top
    peer_cmd = [str(llama.bindir / "llama-server"), "-m", str(a.gguf), "-ngl", "99", "-fa", "on", "-np", str(np_),
                "-c", str(np_ * (a.input_len + a.output_len + 32)), "--host", "127.0.0.1", "--port", str(a.port + 1)]
    with Served("llama-server", peer_cmd, a.port + 1, env=llama.env()) as s:
        result = bench_serving.main(load_args(a, s.base, parts / "llama.json", offline=False))
    result["cmd"] = ["llama-server", *peer_cmd[1:]]
    return result


_NO_PEER = {"metrics": {"output_throughput": math.nan, "failed": 0, "ttft_ms": {"p99": math.nan},
                        "itl_ms": {"p99": math.nan}}}


def rows(pair: dict) -> list[dict]:
    out = []
    ours_levels = pair["ours"]["levels"]
    peer_levels = pair["llama"]["levels"] if "llama" in pair else [_NO_PEER] * len(ours_levels)
    for ours, peer in zip(ours_levels, peer_levels, strict=True):
        m, p = ours["metrics"], peer["metrics"]
        out.append({"concurrency": ours["concurrency"], "offline": ours["offline"]["output_throughput"],
                    "ours": m["output_throughput"], "ours_over_offline": ours["server_over_offline"],
                    "ttft_p99": m["ttft_ms"]["p99"], "itl_p50": m["itl_ms"]["median"], "itl_p99": m["itl_ms"]["p99"],
                    "itl_first_p50": m.get("itl_first_ms", {}).get("median", math.nan),
                    "no_chunk": m.get("tokens_without_chunk", -1),
                    "llama": p["output_throughput"], "llama_ttft_p99": p["ttft_ms"]["p99"],
                    "llama_itl_p99": p["itl_ms"]["p99"], "ours_over_llama": m["output_throughput"] /
                    p["output_throughput"], "failed": m["failed"] + p["failed"]})
    return out


def print_table(pair: dict) -> None:
    print("\n| concurrency | offline tok/s | ours tok/s | ours / offline | TTFT p99 ms | ITL p50 / p99 ms "
          "| first gap p50 ms | tokens without a chunk "
          "| llama-server tok/s | its TTFT p99 / ITL p99 ms | ours / llama-server | failed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows(pair):
        print(f"| {r['concurrency']} | {r['offline']:,.0f} | {r['ours']:,.0f} | {r['ours_over_offline']:.2f} "
              f"| {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} | {r['itl_first_p50']:.1f} "
              f"| {r['no_chunk']} | {r['llama']:,.0f} "
              f"| {r['llama_ttft_p99']:.0f} / {r['llama_itl_p99']:.1f} | {r['ours_over_llama']:.2f} "
              f"| {r['failed']} |")


def plot_pair(pair: dict, stem: Path) -> list[Path]:
    """<stem>.png: output tok/s (offline, ours, llama-server) and TTFT / ITL p99 against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools.bench_serving_report import _x_axis

    rs = rows(pair)
    xs = [r["concurrency"] for r in rs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, style, label in (("offline", "^:", "offline engine (batch = concurrency)"),
                              ("ours", "o-", "ours, through the server"), ("llama", "s--", "llama-server")):
        a1.plot(xs, [r[key] for r in rs], style, label=label)
    a1.set(title="output tokens / s", xlabel="concurrent streams", ylabel="tok/s")
    for key, style, label in (("ttft_p99", "o-", "ours TTFT p99"), ("itl_p99", "o:", "ours ITL p99"),
                              ("llama_ttft_p99", "s--", "llama-server TTFT p99"),
                              ("llama_itl_p99", "s:", "llama-server ITL p99")):
        a2.plot(xs, [r[key] for r in rs], style, label=label)
    a2.set(title="latency p99", xlabel="concurrent streams", ylabel="ms", yscale="log")
    for ax in (a1, a2):
        _x_axis(ax, xs)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(pair['gguf']).name}: {pair['input_len']} prompt + {pair['output_len']} output tokens, "
                 "streamed /v1/completions")
    fig.tight_layout()
    path = stem.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the GGUF file both servers serve")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--num-prompts", default="8,32,128,256", help="per level, as bench_serving takes it")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--backend", default="cuda", help="ours and the offline engine")
    ap.add_argument("--decode-step-tokens", type=int, help="our server's and the offline engine's (default: theirs; "
                    "0: the budget off)")
    ap.add_argument("--prefill-spread-steps", type=int, default=16, help="our server's and the offline engine's")
    ap.add_argument("--max-num-batched-tokens", type=int, help="our server's and the offline engine's (default: "
                    "theirs)")
    ap.add_argument("--prefill-burst-tokens", type=int, help="our server's and the offline engine's (default: "
                    "theirs; 0: off)")
    ap.add_argument("--no-peer", action="store_true", help="ours only (checking the tool without llama.cpp)")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--mem", type=int, default=12288, help="KV MiB for our server and for the offline engine each")
    ap.add_argument("--long-prompts", default="", help="after the levels: one request of each of these prompt "
                    "lengths alone on our server (e.g. 4000,30000), then /health")
    ap.add_argument("--long-output-len", type=int, default=64)
    ap.add_argument("--llama-np", type=int, help="llama-server slots (default: the largest concurrency)")
    ap.add_argument("--llama-cpp", type=Path, help="folder of llama.cpp binaries or its tarball")
    ap.add_argument("--port", type=int, default=2400, help="ours; llama-server takes the next one")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/serving_pair"))
    ap.add_argument("--plot", type=Path, help="only redraw the plots (and table) of this serving_pair.json")
    a = ap.parse_args(argv)
    if a.plot:
        pair = json.loads(a.plot.read_text())
        print_table(pair)
        for path in plot_pair(pair, a.plot.with_suffix("")):
            print(f"plot: {path}")
        return
    if a.gguf is None or not a.gguf.is_file():
        ap.error(f"--gguf: no such file {a.gguf}")
    run(a)


if __name__ == "__main__":
    main()
