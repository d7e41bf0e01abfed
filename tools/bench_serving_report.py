"""tools/bench_serving's figures: per-level metrics (vLLM's: TTFT, TPOT, ITL, end-to-end latency; request,
output and total token throughput), the printed table, the JSON result and the plots of a sweep."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tools.bench_serving_client import RequestResult

__all__ = ["LATENCIES", "plot_sweep", "print_level", "summarize", "write_json"]

LATENCIES = ("ttft", "tpot", "itl", "e2el")
_TITLES = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
           "e2el": "end-to-end latency"}
_STATS = ("mean", "median", "p90", "p99")


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {k: 0.0 for k in _STATS}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """One level's figures; the per-request ones too (tokens, TTFT, e2e, ITL count) for whoever checks them."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "usage_reported": all(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([t for r in ok for t in r.itl_s]),
        # By position: each request's first gap (after the step that prefilled it) against the rest, and the gaps
        # that spanned more than one token (a token whose text the server held back, e.g. part of a UTF-8
        # character, sends no chunk of its own: the next chunk's gap covers both, about 2x a step).
        "itl_first_ms": _stats_ms([r.itl_s[0] for r in ok if r.itl_s]),
        "itl_rest_ms": _stats_ms([t for r in ok for t in r.itl_s[1:]]),
        "tokens_without_chunk": sum(max(0, r.output_tokens - 1 - len(r.itl_s)) for r in ok),
        "e2el_ms": _stats_ms([r.e2e_s for r in ok]),
        "requests": [{"ok": r.ok, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                      "ttft_ms": r.ttft_s * 1e3, "e2el_ms": r.e2e_s * 1e3, "itl_count": len(r.itl_s),
                      **({"error": r.error} if r.error else {})} for r in results],
    }


def print_level(level: dict) -> None:
    m = level["metrics"]
    head = f" concurrency {level['concurrency'] or '-'}, request rate {level['request_rate']:g}/s "
    print(f"\n{head:=^64}")
    rows = [("successful requests", f"{m['completed']}"), ("failed requests", f"{m['failed']}"),
            ("duration (s)", f"{m['duration_s']:.2f}"), ("input tokens", f"{m['total_input_tokens']}"),
            ("output tokens", f"{m['total_output_tokens']}" + ("" if m["usage_reported"] else " (chunks)")),
            ("request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("output token throughput (tok/s)", f"{m['output_throughput']:.1f}"),
            ("total token throughput (tok/s)", f"{m['total_token_throughput']:.1f}")]
    if "offline" in level:
        off = level["offline"]
        rows += [(f"offline output tok/s (batch {off['max_num_seqs']})", f"{off['output_throughput']:.1f}"),
                 ("server / offline (output tok/s)", f"{level['server_over_offline']:.2f}")]
    if "engine" in level:
        e = level["engine"]
        rows += [("engine steps (tokens generated a step)", f"{e['steps']:.0f} ({e['tokens_per_step']:.1f})"),
                 ("engine ms a step (the level's wall time)", f"{e['step_ms']:.2f}")]
    for name, value in rows:
        print(f"{name:<44}{value:>20}")
    for key in LATENCIES:
        s = m[f"{key}_ms"]
        print(f"{key.upper() + ' ms: mean / median / p99':<34}{s['mean']:>10.2f}{s['median']:>10.2f}{s['p99']:>10.2f}")
    if "itl_first_ms" in m:
        first, rest = m["itl_first_ms"], m["itl_rest_ms"]
        print(f"{'ITL ms, first gap / the rest: p50, p99':<44}"
              f"{first['median']:.1f}, {first['p99']:.1f} / {rest['median']:.1f}, {rest['p99']:.1f}")
        print(f"{'tokens that came without a chunk of their own':<44}{m['tokens_without_chunk']:>20}")
    for err in m["errors"]:
        print(f"error: {err}")


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def _x_axis(ax, xs: list[float]) -> None:
    """A log axis for a wide sweep (1, 16, 64), ticked at the measured values."""
    if max(xs) / min(xs) > 8:
        ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()


def plot_sweep(result: dict, stem: Path) -> list[Path]:
    """`<stem>_latency.png` (each latency's mean, median and p99 against the swept variable) and
    `<stem>_throughput.png` (output and total tokens a second, server and offline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    axis = result["sweep"]  # "concurrency" or "request_rate"
    xs = [lv[axis] for lv in levels]
    xlabel = "concurrency (requests in flight)" if axis == "concurrency" else "request rate (req/s)"
    title = f"{result['model']} at {result['base_url']} ({result['endpoint']})"
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    for ax, key in zip(axes.flat, LATENCIES, strict=True):
        for stat, style in (("mean", "o-"), ("median", "s--"), ("p99", "^:")):
            ax.plot(xs, [lv["metrics"][f"{key}_ms"][stat] for lv in levels], style, label=stat)
        _x_axis(ax, xs)
        ax.set(title=_TITLES[key], xlabel=xlabel, ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    lat = stem.with_name(stem.name + "_latency.png")
    fig.savefig(lat, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [lv["metrics"]["output_throughput"] for lv in levels], "o-", label="output tok/s")
    ax.plot(xs, [lv["metrics"]["total_token_throughput"] for lv in levels], "s--", label="total tok/s")
    offline = [(lv[axis], lv["offline"]["output_throughput"]) for lv in levels if "offline" in lv]
    if offline:
        ax.plot(*zip(*offline, strict=True), "^:", label="offline engine, output tok/s")
    _x_axis(ax, xs)
    ax.set(title=title, xlabel=xlabel, ylabel="tokens / s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    thr = stem.with_name(stem.name + "_throughput.png")
    fig.savefig(thr, dpi=110)
    plt.close(fig)
    return [lat, thr]
