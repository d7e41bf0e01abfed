"""The report of tools.bench_gguf from its merged results.json: every figure with its memory roofline and the ratio
of the two engines, as Markdown (stdout and DIR/report.md) and JSON (DIR/report.json), and the decode-vs-context
plot (DIR/decode_vs_context.png); a shape other than llama3-8b reads results-SHAPE.json and writes report-SHAPE.*.
Needs no GPU: results.json brought back from the GPU machine will do."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tools.bench_gguf import FILES, GEN, suffix
from tools.moe_bytes import PARTS, ROUTED, expert_share

PLOT_NAME = "decode_vs_context.png"


def step_weight_bytes(info: dict, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads: every tensor once (the embedding but for its rows), of an
    expert stack only the share of experts a random routing of `batch` tokens picks."""
    experts = info.get("expert_bytes", 0)
    if not experts:
        return info["read_bytes"]
    return info["read_bytes"] - experts + experts * expert_share(info["top_k"], info["experts"], batch)


def roofline(results: dict, fig: dict) -> float | None:
    """Decode tok/s if every step only streamed its bytes at the copy bandwidth: the weights once (step_weight_bytes)
    plus each sequence's KV cache at the timed steps' mean length. None for prefill (compute-bound) or without the
    copy bandwidth (the ours stage measures it) or the file's sizes."""
    info, bw = results.get("files", {}).get(fig["file"]), results.get("env", {}).get("copy_gbs")
    if fig["kind"] != "decode" or not info or not bw:
        return None
    kv = fig["batch"] * (fig["context"] + GEN / 2) * info["kv_bytes_per_token"]
    return fig["batch"] * bw * 1e9 / (step_weight_bytes(info, fig["batch"]) + kv)


def _side(fig: dict, *names: str) -> dict | None:
    return next((fig[n] for n in names if fig.get(n, {}).get("tok_s")), None)


def rows(results: dict) -> list[dict]:
    """One row per figure, in a reading order: file, decode before prefill, context, batch."""
    order = list(FILES)
    figs = sorted(results.get("figures", {}).values(), key=lambda f: (
        order.index(f["file"]) if f["file"] in order else len(order), f["kind"] != "decode", f["context"],
        f["batch"]))
    out = []
    for f in figs:
        ours, peer = _side(f, "ours"), _side(f, "llamacpp", "llamacpp_batched")
        roof = roofline(results, f)
        row = {"figure": _label(f), "file": f["file"], "kind": f["kind"], "batch": f["batch"], "context": f["context"],
               "ours": ours["tok_s"] if ours else None, "llamacpp": peer["tok_s"] if peer else None,
               "roofline": roof, "ours_time": ours and ours["time"], "llamacpp_time": peer and peer["time"],
               "llamacpp_tool": peer and peer["tool"]}
        row["ours_of_roofline"] = row["ours"] / roof if roof and row["ours"] else None
        row["llamacpp_of_roofline"] = row["llamacpp"] / roof if roof and row["llamacpp"] else None
        row["ours_vs_llamacpp"] = row["ours"] / row["llamacpp"] if row["ours"] and row["llamacpp"] else None
        out.append(row)
    return out


def _label(f: dict) -> str:
    name = FILES.get(f["file"], ("", None))[1] or f["file"].upper()
    if f["kind"] == "prefill":
        return f"{name} prefill {f['context']}"
    return f"{name} decode b{f['batch']} @ {_k(f['context'])}"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _num(v: float | None) -> str:
    return f"{v:,.0f}" if v is not None and v >= 100 else (f"{v:,.1f}" if v is not None else "-")


def _pct(v: float | None) -> str:
    return f"{v:.0%}" if v is not None else "-"


def markdown(results: dict) -> str:
    env, files = results.get("env", {}), results.get("files", {})
    lines = ["# Our CUDA backend and llama.cpp on the same GGUF files", "", _shape_line(env, files),
             f"GPU: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, copy bandwidth "
             f"{_num(env.get('copy_gbs'))} GB/s; llama.cpp: {env.get('llama_cpp', '?')}", ""]
    for name, info in files.items():
        extra = f", ours resident {info['ours_resident_bytes'] / 1e9:.2f} GB ({info.get('ours_backend', '')})" \
            if "ours_resident_bytes" in info else ""
        kinds = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(info.get("bytes_by_type", {}).items()))
        read = f"{info['read_bytes'] / 1e9:.2f} GB read per decode step"
        if info.get("expert_bytes"):
            read = (f"{info['read_bytes'] / 1e9:.2f} GB of weights ({info['expert_bytes'] / 1e9:.2f} GB in routed "
                    f"experts), {step_weight_bytes(info, 1) / 1e9:.2f} GB read by a batch-1 decode step"
                    f"{_parts(info)}")
        kv = f", KV {info['kv_bytes_per_token'] / 1024:.1f} KiB a token" if "kv_bytes_per_token" in info else ""
        lines.append(f"- {name}: {info['file_bytes'] / 1e9:.2f} GB file ({kinds} GB), {read}{kv}{extra}")
    lines += ["", "| figure | ours tok/s | of roofline | llama.cpp tok/s | of roofline | ours / llama.cpp | roofline |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows(results):
        ratio = f"{r['ours_vs_llamacpp']:.2f}x" if r["ours_vs_llamacpp"] else "-"
        lines.append(f"| {r['figure']} | {_num(r['ours'])} | {_pct(r['ours_of_roofline'])} | {_num(r['llamacpp'])} "
                     f"| {_pct(r['llamacpp_of_roofline'])} | {ratio} | {_num(r['roofline'])} |")
    lines += ["", f"Decode: `b` sequences with `@` tokens each already in the cache, {GEN} more tokens timed (prefill "
              "untimed); llama.cpp batch 1 is llama-bench tg at that depth, larger batches llama-batched-bench S_TG. "
              "Prefill: one prompt, llama-bench pp. Roofline: copy bandwidth / (weights read per step + the batch's "
              "KV at the mean timed length), an upper bound that ignores compute (binding at large batches); of a "
              "MoE's routed expert stacks only the share a random routing of the batch's tokens picks, 1 - (1 - "
              "top_k / experts) ^ batch (shared experts, attention and dense layers in full); an MLA file's KV is "
              "its one latent row a token and layer.", ""]
    for s in results.get("stages", []):
        lines.append(f"- stage {s['stage']}: {s['started']} .. {s.get('finished', '(cut off)')} ({s.get('argv', '')})")
    for e in results.get("errors", []):
        lines.append(f"- error in {e['stage']} at {e['time']}: {e['what']}: {e['error'].splitlines()[0][:200]}")
    return "\n".join(lines) + "\n"


def _parts(info: dict) -> str:
    """Where a batch-1 step's weight bytes go (files noted before bytes_by_part was kept have none)."""
    parts = dict(info.get("bytes_by_part") or {})
    if not parts:
        return ""
    parts[ROUTED] = parts.get(ROUTED, 0) * expert_share(info["top_k"], info["experts"], 1)
    return " (" + ", ".join(f"{p} {parts[p] / 1e9:.3f}" for p in PARTS if parts.get(p)) + " GB)"


def _shape_line(env: dict, files: dict) -> str:
    """The model: the shape, its layer count (a MoE may run on fewer than its checkpoint's) and experts."""
    info = next(iter(files.values()), {})
    moe = f", {info['experts']} experts, top {info['top_k']}" if info.get("experts") else ""
    layers = f"{info['layers']} layers" if "layers" in info else "layers unknown"
    return f"Model: synthetic {env.get('shape', 'llama3-8b')} shape ({info.get('arch', '?')}, {layers}{moe}), random " \
        "weights.\n"


def plot(results: dict, path: Path, file: str = "f16", batches: tuple[int, ...] = (1, 16)) -> Path | None:
    """Decode tok/s against context, one panel per batch size, ours and llama.cpp (and the roofline), log-x.
    None when matplotlib is missing or no figure has a curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    data = [r for r in rows(results) if r["file"] == file and r["kind"] == "decode" and r["batch"] in batches]
    if not data:
        return None
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        pts = sorted((r for r in data if r["batch"] == b), key=lambda r: r["context"])
        for key, label, style in (("ours", "ours (CUDA backend)", "o-"), ("llamacpp", "llama.cpp", "s--"),
                                  ("roofline", "memory roofline", ":")):
            xy = [(r["context"], r[key]) for r in pts if r[key]]
            if xy:
                ax.plot(*zip(*xy, strict=True), style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["context"] for r in pts], [_k(r["context"]) for r in pts])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens in the KV cache)")
        ax.set_ylabel("decode tok/s" + (" (all sequences)" if b > 1 else ""))
        ax.set_title(f"{file.upper()} decode, batch {b}")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"decode against context on {results.get('env', {}).get('gpu', 'the GPU')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(results: dict, folder: Path, out: Path | None = None, shape: str = "llama3-8b") -> list[Path]:
    text = markdown(results)
    print(text, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / f"report{suffix(shape)}.md", folder / f"report{suffix(shape)}.json"
    md.write_text(text)
    js.write_text(json.dumps({"env": results.get("env", {}), "files": results.get("files", {}),
                              "rows": rows(results)}, indent=1))
    written = [md, js]
    png = plot(results, folder / PLOT_NAME.replace(".png", f"{suffix(shape)}.png"))
    written += [png] if png else []
    if png is None:
        print("(no plot: matplotlib missing or no decode figures)")
    if out is not None and out.resolve() != folder.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for p in written:
            shutil.copy(p, out / p.name)
    return written


def stage_report(args: argparse.Namespace) -> None:
    path = args.dir / f"results{suffix(args.shape)}.json"
    if not path.exists():
        raise SystemExit(f"{path}: no results yet (run the llamacpp and ours stages)")
    write_report(json.loads(path.read_text()), args.dir, args.out, args.shape)
