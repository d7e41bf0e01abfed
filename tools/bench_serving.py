"""A serving benchmark, like `vllm bench serve`: streamed requests to any OpenAI-compatible server (ours,
llama-server, vLLM) at fixed concurrencies or Poisson request rates, with TTFT, TPOT, ITL, end-to-end latency and
throughput per level, a JSON result, plots of a sweep, and (--offline) the same workload through the offline
engine in the same run.

    python -m tools.bench_serving --base-url http://127.0.0.1:2000 --concurrency 1,16,64 --num-prompts 64 \\
        --input-len 128 --output-len 128 [--offline] [--result-file out/bench.json]
    python -m tools.bench_serving --request-rate 1,2,4 --dataset sharegpt.json --chat ...

Random prompts are token ids (ours and vLLM take a list of ids as `prompt`; --random-text sends text instead);
ShareGPT prompts are each conversation's first human turn. Outputs are exactly max_tokens long where the server
honours `ignore_eos` (ours, vLLM, llama-server; --min-tokens also sends min_tokens). Tokens are counted from the
usage the server puts in the last streamed chunk (stream_options.include_usage), else one per text chunk.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import time
from pathlib import Path

from tools.bench_serving_client import Target, engine_counters, run_load, served_model
from tools.bench_serving_data import BenchPrompt, load_tokenizer, random_prompts, sharegpt_prompts
from tools.bench_serving_report import plot_sweep, print_level, summarize, write_json

SERVER_MAX_NUM_SEQS = 64  # our server's default --max-num-seqs: the offline batch when concurrency is unbounded


def _numbers(text: str) -> list[float]:
    return [math.inf if v.strip() in ("inf", "") else float(v) for v in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    srv = ap.add_argument_group("the server")
    srv.add_argument("--base-url", default="http://127.0.0.1:2000", help="the server's root (a /v1 suffix is fine)")
    srv.add_argument("--model", help="the model field of each request (default: the first of GET /v1/models)")
    srv.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a bearer token")
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                     help="ask for outputs of exactly max_tokens (an extra body field)")
    srv.add_argument("--min-tokens", action="store_true", help="also send min_tokens = max_tokens")
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    load = ap.add_argument_group("the load (one of --concurrency and --request-rate may list several values)")
    load.add_argument("--concurrency", type=str, default=None,
                      help="requests in flight at most, e.g. 1,16,64 (default: no bound)")
    load.add_argument("--request-rate", type=str, default="inf",
                      help="Poisson arrivals a second, e.g. 2 or 1,2,4 (inf: all at once)")
    load.add_argument("--num-prompts", type=str, default="100",
                      help="requests per level: one value, or one per level of the sweep (e.g. 8,32,128)")
    load.add_argument("--client-procs", type=int, default=1,
                      help="client processes sharing each level's load (one Python client tops out near 20-40k "
                      "streamed events a second)")
    load.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before the first level")
    load.add_argument("--seed", type=int, default=0, help="for the prompts and the arrival times")
    data = ap.add_argument_group("the prompts")
    data.add_argument("--dataset", type=Path, help="a ShareGPT-format JSON file (default: random prompts)")
    data.add_argument("--input-len", type=int, default=128, help="random prompts: tokens per prompt")
    data.add_argument("--output-len", type=int, default=None,
                      help="max_tokens: 128 for random prompts; with --dataset the reference answers' lengths")
    data.add_argument("--range-ratio", type=float, default=0.0, help="random lengths uniform within +-this share")
    data.add_argument("--random-text", action="store_true", help="random prompts as text (servers without id prompts)")
    data.add_argument("--max-input-len", type=int, default=1024, help="ShareGPT: skip longer first turns")
    data.add_argument("--max-output-len", type=int, default=256, help="ShareGPT: cap max_tokens")
    data.add_argument("--tokenizer", help="GGUF file, HF folder or tokenizer.json of the served model, for lengths "
                      "and random ids (default: our default model's)")
    off = ap.add_argument_group("the offline engine, for the server / offline ratio")
    off.add_argument("--offline", action="store_true", help="also run each level's prompts through frontend.engine "
                     "(LLM) in this process, batch = the level's concurrency")
    off.add_argument("--offline-model", help="GGUF file or HF folder (default: our default model)")
    off.add_argument("--offline-backend", default="auto")
    off.add_argument("--offline-mem", type=int, help="offline KV cache in MiB (default: the backend's, as serving)")
    off.add_argument("--offline-decode-step-tokens", type=int, default=None,
                     help="the offline engine's --decode-step-tokens (default: the engine's; give the server's value)")
    off.add_argument("--offline-prefill-spread-steps", type=int, default=16,
                     help="the offline engine's --prefill-spread-steps (give the server's value)")
    off.add_argument("--offline-max-num-batched-tokens", type=int, default=None,
                     help="the offline engine's --max-num-batched-tokens (default: the engine's; give the server's)")
    off.add_argument("--offline-prefill-burst-tokens", type=int, default=None,
                     help="the offline engine's --prefill-burst-tokens (default: the engine's; give the server's)")
    out = ap.add_argument_group("output")
    out.add_argument("--result-file", type=Path, default=Path("bench_serving.json"),
                     help="the JSON result; a sweep's plots go beside it as <stem>_latency.png, <stem>_throughput.png")
    out.add_argument("--no-plot", action="store_true")
    out.add_argument("--disable-tqdm", action="store_true")
    args = ap.parse_args(argv)
    args.concurrencies = [int(c) for c in _numbers(args.concurrency)] if args.concurrency else [None]
    args.rates = _numbers(args.request_rate)
    if len(args.concurrencies) > 1 and len(args.rates) > 1:
        ap.error("sweep one of --concurrency and --request-rate; give the other one value")
    levels = max(len(args.concurrencies), len(args.rates))
    counts = [int(v) for v in args.num_prompts.split(",")]
    if len(counts) not in (1, levels) or min(counts) < 1:
        ap.error(f"--num-prompts takes one count or one per level ({levels})")
    args.level_prompts = counts * levels if len(counts) == 1 else counts
    if args.chat and args.dataset is None:
        args.random_text = True  # a chat message is text
    return args


def make_prompts(args: argparse.Namespace, tokenizer, n: int, seed: int) -> list[BenchPrompt]:
    if args.dataset:
        return sharegpt_prompts(args.dataset, tokenizer, n, seed, args.max_input_len, args.max_output_len,
                                args.output_len)
    return random_prompts(tokenizer, n, args.input_len, args.output_len or 128, seed, args.random_text,
                          args.range_ratio)


class Offline:
    """The same workload through the offline engine: one backend, an engine per batch size."""

    def __init__(self, args: argparse.Namespace):
        from backends.base import create_backend
        from ir.default_model import default_model_path
        from ir.loader import load_model

        self.model = load_model(args.offline_model or default_model_path(), progress=False)
        self.backend = create_backend(args.offline_backend, self.model)
        self.kv_bytes = args.offline_mem * 2**20 if args.offline_mem else None
        self.chat, self.temperature, self.ignore_eos = args.chat, args.temperature, args.ignore_eos
        self.decode_step_tokens = args.offline_decode_step_tokens
        self.prefill_spread_steps = args.offline_prefill_spread_steps
        self.max_num_batched_tokens = args.offline_max_num_batched_tokens
        self.prefill_burst_tokens = args.offline_prefill_burst_tokens

    def _ids(self, p: BenchPrompt) -> list[int]:
        tok = self.model.tokenizer
        if self.chat:
            return tok.apply_chat_template([{"role": "user", "content": p.prompt}])
        return list(p.prompt) if not isinstance(p.prompt, str) else tok.encode(p.prompt)

    def run(self, prompts: list[BenchPrompt], max_num_seqs: int) -> dict:
        from core.sampling_params import SamplingParams
        from frontend.engine.engine import EngineConfig
        from frontend.engine.llm import LLM
        from frontend.engine.scheduler import SchedulerConfig

        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                decode_step_tokens=self.decode_step_tokens,
                                prefill_spread_steps=self.prefill_spread_steps,
                                prefill_burst_tokens=self.prefill_burst_tokens)
        llm = LLM.from_backend(self.backend, EngineConfig(kv_cache_bytes=self.kv_bytes, scheduler=sched))
        ids = [self._ids(p) for p in prompts]
        params = [SamplingParams(temperature=self.temperature, max_tokens=p.output_len, ignore_eos=self.ignore_eos)
                  for p in prompts]
        llm.generate(ids[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        dt = time.perf_counter() - t
        out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        in_tokens = sum(map(len, ids))
        return {"max_num_seqs": max_num_seqs, "duration_s": dt, "total_input_tokens": in_tokens,
                "total_output_tokens": out_tokens, "request_throughput": len(outs) / dt,
                "output_throughput": out_tokens / dt, "total_token_throughput": (in_tokens + out_tokens) / dt}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    # Each level draws prompts of its own (seed + its index): a prefix cache gains nothing from an earlier level.
    level_prompts = [make_prompts(args, tokenizer, n, args.seed + i) for i, n in enumerate(args.level_prompts)]
    warmup = make_prompts(args, tokenizer, args.warmup, args.seed + len(level_prompts)) if args.warmup else []
    model = args.model or served_model(args.base_url, args.api_key)
    target = Target(args.base_url, model, args.chat, args.api_key, args.temperature, args.ignore_eos, args.min_tokens,
                    timeout_s=args.timeout)
    if warmup:
        results, _ = run_load(target, warmup, 1, progress=False)
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise SystemExit(f"the warm-up request failed: {bad[0]}")
    sweep = "request_rate" if len(args.rates) > 1 else "concurrency"
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "base_url": args.base_url, "endpoint": target.url.split("/v1/")[1], "model": model,
        "dataset": str(args.dataset) if args.dataset else ("random text" if args.random_text else "random ids"),
        "num_prompts": args.level_prompts, "client_procs": args.client_procs, "input_len": args.input_len,
        "output_len": args.output_len, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
        "seed": args.seed, "sweep": sweep,
        "levels": [],
    }
    levels = [(c, r) for c in args.concurrencies for r in args.rates]
    for (concurrency, rate), prompts in zip(levels, level_prompts, strict=True):
        before = engine_counters(args.base_url)
        results, duration = run_load(target, prompts, concurrency, rate, args.seed, not args.disable_tqdm,
                                     args.client_procs)
        after = engine_counters(args.base_url) if before else None
        result["levels"].append({"concurrency": concurrency, "request_rate": rate if math.isfinite(rate) else "inf",
                                 "metrics": summarize(results, duration)})
        if after:  # the engine's side of the level: were its steps full, and how long did one take
            steps = after["steps"] - before["steps"]
            result["levels"][-1]["engine"] = {
                "steps": steps, "generated": after["generated"] - before["generated"],
                "prefilled": after["prefilled"] - before["prefilled"],
                "tokens_per_step": (after["generated"] - before["generated"]) / max(steps, 1),
                "step_ms": 1e3 * duration / max(steps, 1)}
        if not args.offline:
            print_level({**result["levels"][-1], "request_rate": rate})
    if args.offline:
        # Loaded only once every server level is done: an engine resident in this process (its BLAS threads spin
        # after each run) would take CPU from the server on a small machine (0.62x instead of 0.92x on 2 cores).
        offline = Offline(args)
        for level, prompts, (_, rate) in zip(result["levels"], level_prompts, levels, strict=True):
            level["offline"] = offline.run(prompts, level["concurrency"] or SERVER_MAX_NUM_SEQS)
            level["server_over_offline"] = level["metrics"]["output_throughput"] / level["offline"]["output_throughput"]
            print_level({**level, "request_rate": rate})
    write_json(result, args.result_file)
    print(f"\nresult: {args.result_file}")
    if len(result["levels"]) > 1 and not args.no_plot:
        numeric = [lv for lv in result["levels"] if isinstance(lv[sweep], int | float)]
        if len(numeric) == len(result["levels"]):
            for path in plot_sweep(result, args.result_file.with_suffix("")):
                print(f"plot: {path}")
    return result


if __name__ == "__main__":
    main()
