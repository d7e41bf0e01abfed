"""The CUDA backend on a synthetic Llama-3-8B (or llama3-70b / gemma2-9b / phi3-mini / qwen3-30b-a3b with --shape;
random weights made on the GPU, backends/cuda/synthetic: nothing to download), through the engine: decode tok/s at
several batch sizes (128-token prompts, 128 new tokens, EOS ignored), prefill tok/s at 2048 tokens, and the same
decode with GGUF Q4_K/Q6_K blocks laid out as Q4_K_M. The ceilings (copy bandwidth, bf16 GEMM rate) and the
transformers peer (llama's shape) are measured in the same run; every figure is printed with its ratios.

    python -m tools.bench_gpu [--shape llama3-8b|llama3-70b|gemma2-9b|phi3-mini|qwen3-30b-a3b] [--batches 1,16,64]
        [--layers N] [--no-peer] [--no-quant | --quant q4km,int4,fp8] [--ablate 1,64] [--ablations NAMES|none]
        [--decode-table SPEC] [--d ID[,ID..]] [--no-pdl] [--json FILE]

--d ID builds the backend as `python -m frontend --d ID` does (one process, no tensor-parallel workers): the figures
of the path the server takes on one GPU. --d 0,1 is tensor parallel over those GPUs, as the server's `--d 0,1`: a
worker process a GPU, each making its own slice of the same seeded random weights (no file; a Llama-3-70B at TP 2
holds 70 GB a GPU); decode and prefill are measured as on one GPU, the roofline being the GPUs' summed copy bandwidth
over the bytes all ranks read. The transformers peer, the quantized variants and the ablations (rank 0's runner
alone would change) are one GPU's.
--decode-table adds an A/B to the ablations: decode again with another split-K table (backends/cuda/decode_table.py;
tools/bench_decode_attention prints one) on the same backend, graphs captured again.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

from backends.cuda.decode_table import DecodeTable
from ir.config import ModelConfig
from ir.sharding import shard
from tools.bench_gpu_model import SHAPES, active_bytes, loaded_model, meta_params, model_config, quant_params
from tools.bench_gpu_rates import (
    GB,
    copy_bandwidth,
    decode_rate,
    gemm_rate,
    host_profile,
    kernel_profile,
    prefill_flops,
    prefill_rate,
    weight_bytes,
)


def say(*a) -> None:
    print(*a, flush=True)


# --- our engine ------------------------------------------------------------------------------------------------

SEED = 0  # the random weights' (backends/cuda/synthetic): every run and every rank the same model


def cli_options(ids: str | None) -> dict:
    """The backend options `python -m frontend --d IDS` gives (frontend.cli; {} without --d): one GPU, or a list of
    them (tensor parallel)."""
    if ids is None:
        return {}
    from frontend.cli import backend_options, parse_args

    return backend_options(parse_args(["--d", ids]))


def devices_of(options: dict) -> list[str]:
    """The GPUs (tensor parallel's ranks, in order) `options` put the model on."""
    device = options.get("device", "cuda")
    return list(device) if isinstance(device, list | tuple) else [device]


def engine_for(model, params, max_batch: int, ctx: int, graphs: bool = True, backend=None, overlap: bool = True,
               options: dict | None = None, dtype: str = "bf16", pdl: bool = True):
    """An engine over a new backend for `params` (None: the backend's random weights of SEED, each rank making its
    slice), built as the server builds it with `options` (cli_options), or over `backend` (its graphs captured
    again). pdl=False: every kernel launched without programmatic dependent launch (before the graphs' capture)."""
    from backends.base import create_backend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.gc_pauses import freeze_startup
    from frontend.engine.scheduler import SchedulerConfig

    weights = {"params": params} if params is not None else {"random_weights": SEED}
    backend = backend or create_backend("cuda", model, dtype=dtype, cuda_graph=graphs, progress=False, **weights,
                                        **(options or {}))
    if not pdl:
        backend.runner.pdl = backend.runner.attention_pdl = False
    blocks = max_batch * (-(-ctx // 16) + 1) + 64
    config = EngineConfig(num_kv_blocks=blocks, prefix_caching=False, async_scheduling=overlap,
                          scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=4096,
                                                    prefill_chunk_size=4096, decode_step_tokens=0))
    engine = LLMEngine(backend, config)
    freeze_startup()  # as the server does after loading (frontend/engine/gc_pauses.py)
    return engine


ABLATIONS = {  # name -> (runner attribute changes, fusions, engine overlap): each switches one thing off (or on)
    "no async scheduling": ({}, None, False),
    "no PDL": ({"pdl": False}, None, True),
    "no PDL on attention": ({"attention_pdl": False}, None, True),  # the decode/reduce (or prefill) launches only
    "no fused rope+KV write": ({}, {"rope_attention": False}, True),
    # the runner's default: a decode step's rope and cache write inside the decode kernel (kernels_src/
    # paged_decode_rope.py); off, rope_kv_write's launch before it (LLM_ENGINE_ROPE_DECODE=0)
    "no rope decode": ({"rope_decode": False}, None, True),
    "no small decode partitions": ({"decode": DecodeTable(partitions=())}, None, True),
    # split-K partials combined by the decode's last partition, not the reduce kernel (LLM_ENGINE_FUSED_REDUCE=1)
    "fused decode reduce": ({"fused_reduce": True}, None, True),
    # the runner's default: one-row steps through kernels_src/dense_gemv; against cuBLAS throughout, the GEMV up to
    # 8 rows, and with the norms and gated activation before the projections fused in (backends/cuda/gemv_fusion.py)
    "no dense GEMV": ({"dense_gemv": False}, None, True),
    "dense GEMV to 8 rows": ({"dense_gemv": True, "gemv_max_rows": 8}, None, True),
    "dense GEMV with prologues": ({"dense_gemv": True, "gemv_prologues": True}, None, True),
    # 9+ row linears through kernels_src/dense_gemm where its table lists them (LLM_ENGINE_DENSE_GEMM_TUNED=FILE of
    # tools/sweep_dense_gemm --json, or dense_gemm.TUNED): off, every one on cuBLAS
    "no dense GEMM": ({"dense_gemm": False}, None, True),
    # the runner's default: x's int8 form written by the norm / gated activation before a GGUF or int4 GEMV
    # (backends/cuda/x_int8_fusion.py); off, each GEMV quantizes x in a quantize_x(_i8) launch of its own: quantized
    # weights only, so on --quant's engines
    "no x int8 fusion": ({"x_int8_fusion": False}, None, True),
    # Q4_K / Q6_K linears of 33-64 rows on the int8 MMQ (kernels_src/gguf_mmq, per256, x's codes from the norm and
    # activation) instead of dequant_gemm: the runner's MMQ stops at 32 rows (it lost at 64 on 2026-12-03, before the
    # x int8 fusion, with 16-row tiles)
    "MMQ to 64 rows": ({"mmq_max_rows": 64}, None, True),
}
# the kinds of engine an ablation runs on, where not the bf16 one alone ("bf16": that one too): the x int8 fusion
# changes quantized linears only; the rope decode every model's attention
QUANT_ABLATIONS = {"no x int8 fusion": ("q4km", "int4"), "no rope decode": ("bf16", "q4km", "int4"),
                   "MMQ to 64 rows": ("q4km",)}


def ablations(engine, batches: list[int], prompt: int, gen: int, vocab: int,
              entries: dict | None = None) -> dict[str, dict[int, float]]:
    """Decode tok/s with one optimisation off at a time (or `entries` of the same form, e.g. another decode table),
    on the same backend (graphs captured again each time)."""
    from ir.fusion import Fusions

    backend, out = engine.backend, {}
    for name, (attrs, fusions, overlap) in (ABLATIONS if entries is None else entries).items():
        if fusions:
            backend.set_fusions(Fusions(**fusions))
        saved = {k: getattr(backend.runner, k) for k in attrs}
        for k, v in attrs.items():
            setattr(backend.runner, k, v)
        eng = engine_for(None, None, max(batches), prompt + gen, backend=backend, overlap=overlap)
        out[name] = {b: decode_rate(eng, b, prompt, gen, vocab) for b in batches}
        say(f"  {name}: " + ", ".join(f"batch {b} {v:,.0f} tok/s" for b, v in out[name].items()))
        for k, v in saved.items():
            setattr(backend.runner, k, v)
        if fusions:
            backend.set_fusions(Fusions())
        del eng
        gc.collect()
    return out


def ablation_entries(args) -> dict:
    """The ablations --ablations names (all by default), then the --decode-table A/B."""
    names = [n.strip() for n in args.ablations.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ABLATIONS) - {"none"})
    if unknown:
        raise SystemExit(f"unknown ablations {unknown}; known: {', '.join(ABLATIONS)} (or none)")
    entries = {n: ABLATIONS[n] for n in (names or ABLATIONS) if n != "none"}
    if args.decode_table:
        try:
            table = DecodeTable.parse(args.decode_table)
        except ValueError as e:
            raise SystemExit(f"--decode-table: {e}") from None
        entries[f"decode table {table.spec()}"] = ({"decode": table}, None, True)
    return entries


# --- the transformers peer -------------------------------------------------------------------------------------

def _generate_s(model, ids, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def peer_rates(cfg: ModelConfig, batches: list[int], prompt: int, gen: int) -> dict[int, float]:
    """transformers (eager, its default attention) on the same shape: decode tok/s from generate(gen) minus
    generate(1), so that prefill is not counted."""
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
                     rms_norm_eps=cfg.rms_norm_eps, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).eval()
    say(f"peer: transformers {transformers.__version__}, {type(model).__name__} bf16, eager generate")
    out = {}
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, prompt), device="cuda")
        _generate_s(model, ids, 2)
        out[b] = b * (gen - 1) / (_generate_s(model, ids, gen) - _generate_s(model, ids, 1))
        say(f"  peer decode batch {b}: {out[b]:,.0f} tok/s")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


# --- report ----------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--shape", default="llama3-8b", choices=SHAPES, help="the synthetic model's architecture and "
                    "shape (llama3-8b; gemma2-9b and phi3-mini from their config.json)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's, 32 for Llama-3-8B)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-quant", action="store_true", help="no quantized variant (as --quant '')")
    ap.add_argument("--quant", default="q4km", help="quantized variants, of q4km (Q4_K/Q6_K blocks, batch 1 only), "
                    "int4 (4-bit integer groups of 128, GPTQ's once loaded), fp8 (e4m3, a scale per 128 inputs): "
                    "decode at --batches and prefill (default %(default)s)")
    ap.add_argument("--q4km-batches", default="1", help="the --batches q4km decodes at (default %(default)s: its "
                    "batch-16 figure is bench_gguf's, on llama.cpp's own file; others for --profile's breakdown)")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode (for comparison)")
    ap.add_argument("--no-pdl", action="store_true", help="kernels without programmatic dependent launch: "
                    "--profile's times then hold no kernel's wait for the one before it (with PDL they do)")
    ap.add_argument("--ablate", default="1,64", help="batch sizes measured again with each optimisation switched "
                    "off in turn ('' for none)")
    ap.add_argument("--ablations", default="", help="comma-separated names of the ablations to run ('': all, "
                    f"'none': only --decode-table's; of: {', '.join(ABLATIONS)})")
    ap.add_argument("--decode-table", default="", help="also decode with this split-K table in place of the runner's "
                    "(an A/B at the --ablate batch sizes), e.g. '8:64/64x4,128:256/64x4,512,max=64': "
                    "programs:keys[/BLOCK_Nxwarps] entries, the long partition, the grid cap (backends/cuda/"
                    "decode_table.py)")
    ap.add_argument("--profile", default="1,64", help="batch sizes whose decode steps are profiled by kernel ('' for "
                    "none)")
    ap.add_argument("--step-times", action="store_true", help="print every timed decode step's sequences and ms")
    ap.add_argument("--host-profile", default="", help="batch sizes whose decode steps' host time is profiled: the "
                    "wall per step and the CUDA runtime calls by host time (a sync shows as milliseconds)")
    ap.add_argument("--d", metavar="ID", help="the GPU, given as the server's --d (backends.base.create_backend, as "
                    "`python -m frontend --d ID` builds the backend); default: CUDABackend's own")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_gpu.json")
    args = ap.parse_args()
    options = cli_options(args.d)
    devices = devices_of(options)
    world = len(devices)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    if options:
        torch.cuda.set_device(devices[0])  # the ceilings and the peer on that GPU too
    batches = [int(b) for b in args.batches.split(",")]
    entries = ablation_entries(args)  # a mistyped name or table fails before the model is built
    cfg = model_config(args.layers, args.shape)
    if args.prompt + args.gen > cfg.max_position_embeddings:  # random weights: any context the rope table covers
        cfg = cfg.with_(max_position_embeddings=args.prompt + args.gen)
    args.layers = cfg.num_layers
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                 "shape": args.shape, "d": args.d, "world": world}
    res["copy_gbs_each"] = []
    for d in devices:  # each rank's GPU: the roofline is their sum
        with torch.cuda.device(d):
            res["copy_gbs_each"].append(copy_bandwidth())
            torch.cuda.empty_cache()  # the 4 GiB of buffers, before the model needs the room
    res["copy_gbs"] = sum(res["copy_gbs_each"])
    res["gemm_tflops_gpu"] = gemm_rate()
    res["gemm_tflops"] = world * res["gemm_tflops_gpu"]  # prefill's ceiling: every rank's GEMMs at once
    torch.cuda.empty_cache()
    say(f"{res['gpu']} x{world}: copy " + " + ".join(f"{c:,.0f}" for c in res["copy_gbs_each"]) +
        f" GB/s, bf16 GEMM {res['gemm_tflops_gpu']:,.0f} TFLOP/s a GPU")
    # The transformers peer is built as a llama, on one GPU: only for llama's shape, and where one GPU holds it.
    one_gpu = world == 1 and args.shape != "llama3-70b"
    if world > 1:
        say(f"tensor parallel over {devices}: no transformers peer, quantized variants or ablations (one GPU's)")
    res["peer"] = {} if args.no_peer or cfg.arch != "llama" or not one_gpu else peer_rates(cfg, batches, args.prompt,
                                                                                            args.gen)

    t0 = time.perf_counter()
    model = loaded_model(cfg)
    rank_graph = shard(model.graph, 0, world)  # rank 0's share (the graph itself on one GPU)
    # all of a rank's parameters, but for a MoE only the routed experts; every rank reads as many (KV heads
    # replicated where fewer than ranks: each rank its copy), or fewer where heads split unevenly by KV group: rank 0
    # holds the most, so world times its bytes is the bound of the slowest rank's step
    res["rank_bytes"] = active_bytes(rank_graph, meta_params(rank_graph))
    res["bf16_bytes"] = world * res["rank_bytes"]
    engine = engine_for(model, None, max(batches), max(args.prompt + args.gen, args.prefill), not args.no_graphs,
                        options=options, pdl=not args.no_pdl)
    say(f"ours: bf16 model {res['bf16_bytes'] / GB:.2f} GB ({res['rank_bytes'] / GB:.2f} GB a rank) ready in "
        f"{time.perf_counter() - t0:.1f} s")
    res["decode"] = {}
    for b in batches:
        res["decode"][b] = decode_rate(engine, b, args.prompt, args.gen, cfg.vocab_size, show_steps=args.step_times)
        say(f"  decode batch {b}: {res['decode'][b]:,.0f} tok/s")
    res["profile"] = {}
    for b in [int(x) for x in args.profile.split(",") if x]:
        try:
            res["profile"][b] = kernel_profile(engine, b, args.prompt, cfg.vocab_size)
        except Exception as e:  # noqa: BLE001  (the profiler is a diagnostic: the figures matter more)
            say(f"  (profile of batch {b} failed: {type(e).__name__}: {e})")
            continue
        say(f"  decode batch {b}, GPU time by kernel (us per step):")
        for name, share, us in res["profile"][b]:
            say(f"    {us:9.1f} {share:6.1%}  {name}")
    res["host_profile"] = {}
    for b in [int(x) for x in args.host_profile.split(",") if x]:
        try:
            res["host_profile"][b] = host_profile(engine, b, args.prompt, cfg.vocab_size)
        except Exception as e:  # noqa: BLE001  (a diagnostic, as the kernel profile)
            say(f"  (host profile of batch {b} failed: {type(e).__name__}: {e})")
            continue
        say(f"  decode batch {b}, host time in CUDA runtime calls (us per step; calls per step):")
        for name, calls, us in res["host_profile"][b]:
            say(f"    {us:9.1f} {calls:7.1f}  {name}")
    res["prefill_tps"] = prefill_rate(engine, args.prefill, cfg.vocab_size)
    res["prefill_tflops"] = prefill_flops(cfg, args.prefill) * res["prefill_tps"] / args.prefill / 1e12
    say(f"  prefill {args.prefill}: {res['prefill_tps']:,.0f} tok/s, {res['prefill_tflops']:.0f} TFLOP/s")
    ablate = [int(x) for x in args.ablate.split(",") if x] if world == 1 else []  # last: graphs captured again
    dense = {n: e for n, e in entries.items() if "bf16" in QUANT_ABLATIONS.get(n, ("bf16",))}
    res["ablations"] = ablations(engine, ablate, args.prompt, args.gen, cfg.vocab_size, dense) if ablate else {}
    if engine.backend.workers is not None:  # tensor parallel: the workers' GPUs freed now, not at exit
        engine.backend.workers.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()

    res["quant"] = {}
    for kind in [] if args.no_quant or world > 1 else [q for q in args.quant.split(",") if q]:
        qbatches = [b for b in batches if kind != "q4km" or str(b) in args.q4km_batches.split(",")]
        if not qbatches:
            say(f"  {kind}: none of --batches {args.batches} is in --q4km-batches {args.q4km_batches}: skipped")
            continue
        qparams = quant_params(kind, model.graph, args.layers)
        nbytes = weight_bytes(qparams)
        engine = engine_for(model, qparams, max(qbatches), max(args.prompt + args.gen, args.prefill),
                            not args.no_graphs, options=options, pdl=not args.no_pdl)
        del qparams
        fig = res["quant"][kind] = {"bytes": nbytes, "decode": {}}
        for b in qbatches:
            fig["decode"][b] = decode_rate(engine, b, args.prompt, args.gen, cfg.vocab_size)
            say(f"  {kind} ({nbytes / GB:.2f} GB) decode batch {b}: {fig['decode'][b]:,.0f} tok/s")
        fig["profile"] = {}
        for b in [int(x) for x in args.profile.split(",") if x and int(x) in qbatches]:
            try:  # where a quantized step's time goes: the formats' kernels against the 16-bit step's
                fig["profile"][b] = kernel_profile(engine, b, args.prompt, cfg.vocab_size)
            except Exception as e:  # noqa: BLE001  (a diagnostic, as above)
                say(f"  ({kind} profile of batch {b} failed: {type(e).__name__}: {e})")
                continue
            say(f"  {kind} decode batch {b}, GPU time by kernel (us per step):")
            for name, share, us in fig["profile"][b]:
                say(f"    {us:9.1f} {share:6.1%}  {name}")
        if kind != "q4km":
            fig["prefill_tps"] = prefill_rate(engine, args.prefill, cfg.vocab_size)
            say(f"  {kind} prefill {args.prefill}: {fig['prefill_tps']:,.0f} tok/s")
        quant_entries = {n: e for n, e in entries.items() if kind in QUANT_ABLATIONS.get(n, ())}
        qablate = [b for b in ablate if b in qbatches]  # last: it recaptures the engine's graphs
        fig["ablations"] = ablations(engine, qablate, args.prompt, args.gen, cfg.vocab_size, quant_entries) if (
            qablate and quant_entries) else {}
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    report(res, args)


def report(res: dict, args) -> None:
    roof = res["copy_gbs"] * GB / res["bf16_bytes"]
    rows = [(f"decode b{b} tok/s", v, v / roof if b == 1 else None, res["peer"].get(b))
            for b, v in res["decode"].items()]
    rows.append((f"prefill {args.prefill} tok/s", res["prefill_tps"], res["prefill_tflops"] / res["gemm_tflops"],
                 None))
    for kind, fig in res["quant"].items():
        for b, v in fig["decode"].items():
            rows.append((f"{kind} decode b{b} tok/s", v, v / (res["copy_gbs"] * GB / fig["bytes"]) if b == 1 else None,
                         None))
        if "prefill_tps" in fig:
            rows.append((f"{kind} prefill {args.prefill} tok/s", fig["prefill_tps"], None, None))
    res["json_rows"] = rows
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1, default=str))
    tp = f" x{res['world']} (tensor parallel, --d {res['d']})" if res["world"] > 1 else ""
    say(f"\nsynthetic {res['shape']} ({res['layers']} layers) on {res['gpu']}{tp}, torch {res['torch']}: copy "
        f"{res['copy_gbs']:,.0f} GB/s -> bf16 batch-1 roofline {roof:.0f} tok/s; bf16 GEMM {res['gemm_tflops']:.0f} "
        "TFLOP/s")
    say(f"{'figure':<26}{'ours':>10}{'of ceiling':>12}{'peer':>10}{'vs peer':>9}")
    for name, v, ceil, peer in rows:
        say(f"{name:<26}{v:>10,.0f}{f'{ceil:.1%}' if ceil else '':>12}{f'{peer:,.0f}' if peer else '':>10}"
            f"{f'{v / peer:.2f}x' if peer else '':>9}")
    say("(ceiling: batch 1 = copy bandwidth / weight bytes; prefill = model TFLOP/s / bf16 GEMM rate; tensor "
        "parallel: the GPUs' sums over the bytes all ranks read)")
    for prefix, decode, ablated in [("", res["decode"], res["ablations"])] + [
            (f"{kind} ", fig["decode"], fig.get("ablations", {})) for kind, fig in res["quant"].items()]:
        for name, rates in ablated.items():
            say(f"{prefix + name:<26}" + "".join(f"  b{b} {v:,.0f} ({v / decode[b] - 1:+.1%})"
                                                 for b, v in rates.items() if b in decode))


if __name__ == "__main__":
    main()
