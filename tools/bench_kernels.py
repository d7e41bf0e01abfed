"""Check and time every registry kernel on a CUDA GPU, per target, against the device's copy bandwidth.

    python -m tools.bench_kernels [--targets triton,cuda] [--only NAME,...] [--quick] [--set KEY=VALUE,... ...]

For each kernel at its registry `bench` size (`--quick`: small sizes, a smoke test) and each target: random inputs
on the GPU, one host-launcher call checked against the numpy reference (tools/kernel_cases.py), then the time of
that call's kernel launches. The launches are recorded once and replayed from a CUDA graph (eager, flagged, where
capture fails), so the DSL's per-launch host work stays out of the device time; inputs rotate over enough copies
that the working set exceeds three times the L2. The floor is a >= 2 GiB device copy (bytes read + written) timed
in the same run. Writes kernels_bench.md and kernels_bench.json under $OUT when it is set; prints a table last.
`--set m=64,n=4096,k=14336` times the named kernels at that problem instead (repeat it for several problems; keys
the case takes beyond the bench's, such as the GEMM's split_k or block_n, sweep launcher options).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass

from kernels_src.registry import REGISTRY
from tools.kernel_case_base import quick_params
from tools.kernel_cases import build_case, has_case

GOALS = {"rms_norm": 80, "rope": 80, "paged_decode": 70, "dequant_gemv_q4_k": 60}  # % of copy bandwidth (the issue)
TARGETS = ("triton", "cuda")
FAILED = ("FAIL", "ERROR")


@dataclass
class Row:
    kernel: str
    target: str
    status: str = "-"  # PASS | FAIL (wrong numbers) | ERROR (raised) | UNSUP (target cannot lower it) | SKIP
    err: float | None = None  # worst relative L2 error against the reference
    us: float | None = None  # device time of one launcher call
    gbps: float | None = None  # bytes_moved(**bench) over that time
    pct: float | None = None  # of the measured copy bandwidth
    tflops: float | None = None
    goal: int | None = None
    met: str = "-"
    method: str = "-"  # graph | eager (host launch overhead may be counted)
    spread: float | None = None  # interquartile range of the timed repeats, % of the median
    first_s: float | None = None  # the first call: JIT compile, launch and sync
    note: str = ""


def target_unavailable(target: str) -> str | None:
    """Why `target` cannot run here, or None."""
    if target == "triton":
        return None if importlib.util.find_spec("triton") else "triton is not installed"
    if target == "cuda":
        from kernels_src.dsl.launch import TARGET_HOOKS

        if "cuda" not in TARGET_HOOKS:
            return "the DSL registers no 'cuda' target"
        if importlib.util.find_spec("kernels_src.dsl.cuda_target") is None:
            return "kernels_src/dsl/cuda_target.py is not there yet (the SIMT CUDA C emitter has not landed)"
        return None if importlib.util.find_spec("cupy") else "cupy is not installed"
    return f"unknown target {target!r} (known: {', '.join(TARGETS)})"


def stream_ctx(torch, target: str):
    """CuPy launches onto torch's current stream (so events and graph capture see them); others as they are."""
    if target != "cuda" or importlib.util.find_spec("cupy") is None:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


@contextlib.contextmanager
def recorded():
    """Every `kernel[grid](*args)` launched inside, as (kernel, grid, args), still launched."""
    from kernels_src.dsl.launch import Kernel

    calls, orig = [], Kernel.__getitem__

    def getitem(self, grid):
        launch = orig(self, grid)

        def run(*args):
            calls.append((self, grid, args))
            return launch(*args)

        return run

    Kernel.__getitem__ = getitem
    try:
        yield calls
    finally:
        Kernel.__getitem__ = orig


def replayer(calls):
    """The recorded launches as one callable, their compiled launchers looked up once."""
    ready = [(k.compiled(*args), (g,) if isinstance(g, int) else tuple(int(x) for x in g), args)
             for k, g, args in calls]

    def run():
        for fn, grid, args in ready:
            fn(grid, *args)

    return run


def events_ms(torch, fn, reps: int) -> list[float]:
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)


def spread_pct(ms: list[float]) -> float:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return 100 * (q[2] - q[0]) / q[1]


def time_calls(torch, run, calls_per_run: int, ctx, quick: bool) -> tuple[float, str, float]:
    """(us per launcher call, method, spread %): replays of a graph of n runs, eager where capture fails."""
    with ctx():
        est = statistics.median(events_ms(torch, run, 3))
    reps = 5 if quick or est > 50 else 15
    n = max(1, min(200, round((1.0 if quick else 3.0) / max(est, 1e-3))))
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), ctx():
            for _ in range(n):
                run()
        g.replay()
        ms = events_ms(torch, g.replay, reps)
        return 1e3 * statistics.median(ms) / (n * calls_per_run), "graph", spread_pct(ms)
    except Exception as e:  # noqa: BLE001 - a launcher that cannot be captured is timed eagerly
        print(f"    graph capture failed ({type(e).__name__}: {str(e)[:200]}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        with ctx():
            ms = events_ms(torch, run, reps)
        return 1e3 * statistics.median(ms) / calls_per_run, "eager", spread_pct(ms)


def copy_gbps(torch, nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()  # random data, never zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = statistics.median(events_ms(torch, lambda: dst.copy_(src), 20))
    return 2 * nbytes / ms / 1e6


def mm_tflops(torch, n: int) -> float:
    a, b = (torch.randn(n, n, device="cuda").bfloat16() for _ in range(2))
    c = torch.mm(a, b)
    ms = statistics.median(events_ms(torch, lambda: torch.mm(a, b, out=c), 10))
    return 2 * n ** 3 / ms / 1e9


def cuda_alive(torch) -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:  # noqa: BLE001 - a sticky error (illegal address ...) leaves the context unusable
        return False


def parse_set(text: str) -> dict:
    """"m=64,swap=false,dtype=float16" -> {"m": 64, "swap": False, "dtype": "float16"}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE pairs, got {item!r}")
        low = val.lower()
        out[key] = int(val) if val.lstrip("-").isdigit() else {"true": True, "false": False}.get(low, val)
    return out


def run_job(torch, name: str, target: str, quick: bool, meta: dict, overrides: dict | None = None) -> Row:
    entry = REGISTRY[name]
    suffix = "[" + ",".join(f"{k}={v}" for k, v in overrides.items()) + "]" if overrides else ""
    row = Row(name + suffix, target, goal=None if overrides else GOALS.get(name))
    reason = target_unavailable(target) or (None if has_case(name) else "no GPU case in tools/kernel_cases.py")
    if reason:
        row.status, row.note = "SKIP", reason
        return row
    params = (quick_params(name, entry.bench) if quick else dict(entry.bench)) | (overrides or {})
    args = {k: params[k] for k in entry.bench}
    ctx = lambda: stream_ctx(torch, target)
    seed = zlib.crc32(f"{name}/{target}".encode())
    calls: list = []
    try:
        case = build_case(name, params, seed)
        t0 = time.perf_counter()
        with ctx():
            case.prepare(target)
        with recorded() as first, ctx():
            case.launch(target)
        torch.cuda.synchronize()
        row.first_s = time.perf_counter() - t0
        row.err, problem = case.check()
        row.status, row.note = ("FAIL", problem) if problem else ("PASS", "")
        main = [k for k, _, _ in first if k.fn is entry.fn]
        if main and not quick and not overrides and main[0].constexprs != entry.constexprs:
            row.note += f" launcher constexprs {main[0].constexprs} differ from the registry's"
        nbytes = entry.bytes_moved(**args)
        sets = max(1, min(8, math.ceil(3 * meta["l2_bytes"] / nbytes)))
        calls = list(first)
        for i in range(1, sets):  # more input sets, so no run finds its inputs in L2
            more = build_case(name, params, seed + i)
            with ctx():
                more.prepare(target)
            with recorded() as rec, ctx():
                more.launch(target)
            calls += rec
        torch.cuda.synchronize()
        row.us, row.method, row.spread = time_calls(torch, replayer(calls), sets, ctx, quick)
        row.gbps = nbytes / row.us / 1e3
        row.pct = 100 * row.gbps / meta["copy_gbps"]
        if entry.flops:
            row.tflops = entry.flops(**args) / row.us / 1e6
            if row.tflops > 0.2 * meta["mm_tflops"]:
                row.note += f" {100 * row.tflops / meta['mm_tflops']:.0f}% of the bf16 mm rate"
        if row.goal is not None:  # a wrong kernel meets no goal
            row.met = ("yes" if row.pct >= row.goal else "no") if row.status == "PASS" else "no"
    except NotImplementedError as e:
        row.status, row.note = "UNSUP", f"{e}"
    except Exception as e:  # noqa: BLE001 - one kernel's failure is reported, the rest still run
        row.status, row.note = "ERROR", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        calls.clear()
    row.note = " ".join(row.note.split())[:600]
    return row


def in_child(jobs: list[tuple[str, str]], opts, meta: dict) -> list[Row]:
    """The remaining jobs in a fresh process (after a sticky CUDA error killed this one's context)."""
    print("CUDA context lost: running the remaining kernels in a fresh process", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "tools.bench_kernels", "--jobs", ",".join(f"{n}:{t}:{v}" for n, t, v in jobs),
               "--child-json", path, "--meta", json.dumps(meta)] + (["--quick"] if opts.quick else [])
        cmd += [a for s in opts.set for a in ("--set", s)]
        subprocess.run(cmd, check=False)
        if os.path.exists(path):
            with open(path) as f:
                return [Row(**r) for r in json.load(f)]
    return [Row(n, t, status="ERROR", note="the fresh process gave no result") for n, t, _ in jobs]


# --- reporting ----------------------------------------------------------------------------------------------------

def _f(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


COLUMNS = [("kernel", 22, lambda r: r.kernel), ("target", 6, lambda r: r.target), ("check", 5, lambda r: r.status),
           ("rel err", 7, lambda r: _f(r.err, ".1e")), ("us", 8, lambda r: _f(r.us, ".1f")),
           ("GB/s", 6, lambda r: _f(r.gbps, ".0f")), ("%copy", 5, lambda r: _f(r.pct, ".1f")),
           ("TFLOP/s", 7, lambda r: _f(r.tflops, ".1f")), ("goal", 5, lambda r: _f(r.goal, "d")),
           ("met", 3, lambda r: r.met), ("timing", 6, lambda r: r.method), ("1st s", 5, lambda r: _f(r.first_s, ".1f"))]


def header(meta: dict) -> str:
    return (f"{meta['device']} | torch {meta['torch']}, triton {meta['triton']}, cupy {meta['cupy']} | "
            f"copy {meta['copy_gbps']:.0f} GB/s ({meta['copy_gib']:g} GiB, read + write) | "
            f"bf16 mm {meta['mm_tflops']:.0f} TFLOP/s | L2 {meta['l2_bytes'] / 2**20:.0f} MiB"
            + (" | QUICK sizes" if meta["quick"] else ""))


def table(rows: list[Row]) -> str:
    lines = ["  ".join(f"{c:<{w}}" for c, w, _ in COLUMNS)]
    lines += ["  ".join(f"{f(r):<{w}}" for _, w, f in COLUMNS) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def markdown(rows: list[Row], meta: dict) -> str:
    cols = [c for c, _, _ in COLUMNS] + ["note"]
    out = ["# Kernel benchmark", "", header(meta), "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join([f(r) for _, _, f in COLUMNS] + [r.note.replace("|", "/")[:300]]) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _clean(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def write_out(rows: list[Row], meta: dict) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernels_bench.md"), "w") as f:
        f.write(markdown(rows, meta))
    with open(os.path.join(out, "kernels_bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": [{k: _clean(v) for k, v in asdict(r).items()} for r in rows]}, f, indent=1)


# --- main ---------------------------------------------------------------------------------------------------------

def measure_meta(torch, quick: bool) -> dict:
    props = torch.cuda.get_device_properties(0)
    versions = {}
    for mod in ("triton", "cupy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - reported as absent
            versions[mod] = "absent"
    gib = 0.25 if quick else 2.0
    meta = dict(device=props.name, sms=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", 60 << 20),
                torch=torch.__version__, quick=quick, copy_gib=gib, **versions)
    meta["copy_gbps"] = copy_gbps(torch, int(gib * 2**30))
    meta["mm_tflops"] = mm_tflops(torch, 2048 if quick else 8192)
    gc.collect()
    torch.cuda.empty_cache()
    return meta


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m tools.bench_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: triton,cuda")
    p.add_argument("--only", default="", help="comma-separated registry names (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE,...",
                   help="time at this problem (bench keys overridden, launcher options added); repeatable")
    p.add_argument("--jobs", default="", help=argparse.SUPPRESS)  # name:target,... (a child process)
    p.add_argument("--child-json", default="", help=argparse.SUPPRESS)
    p.add_argument("--meta", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse(argv)
    names = [n for n in opts.only.split(",") if n] or list(REGISTRY)
    targets = [t for t in opts.targets.split(",") if t]
    unknown = [n for n in names if n not in REGISTRY] + [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"unknown kernel or target: {', '.join(unknown)} (kernels: {', '.join(REGISTRY)}; targets: "
              f"{', '.join(TARGETS)})", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("no CUDA GPU: torch is missing or torch.cuda.is_available() is False; this tool times kernels on a "
              "CUDA device (tests/test_kernels_*.py check them on the CPU)", file=sys.stderr)
        return 2
    sets = [parse_set(s) for s in opts.set] or [{}]
    jobs = [(n, t, int(v)) for n, t, v in (j.split(":") for j in opts.jobs.split(","))] if opts.jobs else [
        (n, t, v) for n in names for v in range(len(sets)) for t in targets]
    t0 = time.perf_counter()
    meta = json.loads(opts.meta) if opts.meta else measure_meta(torch, opts.quick)
    if not opts.child_json:
        print(header(meta), flush=True)
    rows: list[Row] = []
    for i, (name, target, v) in enumerate(jobs):
        row = run_job(torch, name, target, opts.quick, meta, sets[v])
        rows.append(row)
        gc.collect()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        print(f"[{i + 1}/{len(jobs)}] {row.kernel} {target}: {row.status} {_f(row.us, '.1f')} us "
              f"{_f(row.pct, '.1f')}% copy ({time.perf_counter() - t0:.0f} s) {row.note[:300]}", flush=True)
        if row.status in FAILED and i + 1 < len(jobs) and not cuda_alive(torch):
            rows += in_child(jobs[i + 1:], opts, meta)
            break
    if opts.child_json:
        with open(opts.child_json, "w") as f:
            json.dump([asdict(r) for r in rows], f)
        return 0
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    write_out(rows, meta)
    notes = [f"  {r.kernel} {r.target}: {r.note}" for r in rows if r.note]
    print("\nnotes:\n" + "\n".join(notes) if notes else "")
    print(f"\n{header(meta)} | {meta['wall_s']:.0f} s\n{table(rows)}")
    return 1 if any(r.status in FAILED for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
