"""Issue 19's figures from one run's JSON files (tools/gpu_check.sh's bench_tp step): each GPU's copy bandwidth and
the all-reduce at decode sizes (tools/bench_allreduce), Llama-3-8B at TP 1 against TP 2 (tools/bench_gpu --d 0 and
--d 0,1), Llama-3-70B at TP 2 against the two GPUs' combined copy roofline; each against the issue's target.

    python -m tools.bench_tp_report --dir DIR [--json FILE]     (DIR: allreduce.json, tp1.json, tp2.json, tp2_70b.json)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

GB = 1e9
TARGETS = {"8B TP 2 / TP 1 decode b1": 1.5, "8B TP 2 / TP 1 decode b64": 1.6, "70B TP 2 decode b1 of roofline": 0.70}


def load(folder: Path) -> dict:
    """The files that exist (a step that failed leaves its file out)."""
    names = {"allreduce": "allreduce.json", "tp1": "tp1.json", "tp2": "tp2.json", "tp2_70b": "tp2_70b.json"}
    return {k: json.loads((folder / f).read_text()) for k, f in names.items() if (folder / f).exists()}


def roofline(run: dict) -> float:
    """Batch-1 tok/s at the GPUs' summed copy bandwidth over the bytes all ranks read (bench_gpu's own)."""
    return run["copy_gbs"] * GB / run["bf16_bytes"]


def figures(res: dict) -> list[tuple[str, float | None, float | None]]:
    """(name, value, target) rows; a value None where its run is missing."""
    rows: list[tuple[str, float | None, float | None]] = []
    ar = res.get("allreduce")
    if ar:
        rows += [(f"copy GB/s, {d}", c, None) for d, c in zip(ar["devices"], ar["copy_gbs"], strict=True) if c]
        for r in ar["rows"]:
            if r["bytes"] in (8192, 16 * 8192, 64 * 8192):  # 1, 16 and 64 rows of 4096 in bf16
                rows.append((f"all-reduce {r['bytes'] // 8192} x 4096 bf16 us", r["us"], None))
                if r.get("graph_us"):
                    rows.append((f"  in a CUDA graph, {r['bytes'] // 8192} x 4096 us", r["graph_us"], None))
        rows.append(("all-reduce peak bus GB/s", max(r["bus_gbs"] for r in ar["rows"]), None))
    tp1, tp2 = res.get("tp1"), res.get("tp2")
    for b in ("1", "16", "64"):
        one, two = (run["decode"].get(b) if run else None for run in (tp1, tp2))
        rows += [(f"8B TP 1 decode b{b} tok/s", one, None), (f"8B TP 2 decode b{b} tok/s", two, None)]
        if one and two:
            rows.append((f"8B TP 2 / TP 1 decode b{b}", two / one, TARGETS.get(f"8B TP 2 / TP 1 decode b{b}")))
    for name, run in (("8B TP 1", tp1), ("8B TP 2", tp2)):
        if run:
            rows.append((f"{name} prefill tok/s", run["prefill_tps"], None))
            rows.append((f"{name} decode b1 of roofline", run["decode"]["1"] / roofline(run), None))
    big = res.get("tp2_70b")
    if big:
        rows.append(("70B TP 2 decode b1 tok/s", big["decode"]["1"], None))
        rows.append(("70B TP 2 roofline tok/s", roofline(big), None))
        rows.append(("70B TP 2 decode b1 of roofline", big["decode"]["1"] / roofline(big),
                     TARGETS["70B TP 2 decode b1 of roofline"]))
        if big.get("prefill_tps"):
            rows.append(("70B TP 2 prefill tok/s", big["prefill_tps"], None))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_tp.json")
    args = ap.parse_args()
    res = load(args.dir)
    rows = figures(res)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": res, "figures": rows}, indent=1, default=str))
    print(f"\n{'issue 19 figure':<42}{'value':>12}{'target':>9}")
    for name, v, target in rows:
        value = "missing" if v is None else f"{v:,.3f}" if v < 10 else f"{v:,.0f}"
        met = "" if target is None or v is None else f">= {target} {'met' if v >= target else 'NOT met'}"
        print(f"{name:<42}{value:>12}  {met}")
    missing = [k for k in ("allreduce", "tp1", "tp2", "tp2_70b") if k not in res]
    print(f"(all runs' JSON in {args.json}; runs missing: {', '.join(missing) or 'none'})")


if __name__ == "__main__":
    main()
