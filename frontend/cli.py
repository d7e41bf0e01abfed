"""`python -m frontend`: load a model and serve it over the OpenAI API (or, with --prompt, answer once)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from backends.base import KV_CACHE_DTYPES, kv_cache_quant
from frontend.cli_launch import check_flag_world, device_ids, launcher_rank, mlx_launch_rank
from frontend.model_source import resolve
from ir.isq import ISQ_TYPES, isq_kind
from ir.pooling import RUNNER_TASKS, TASKS, task_of

log = logging.getLogger("frontend")

# Flags of docs/FEATURES.md whose feature is not built yet: refused, never silently ignored.
NOT_YET: dict[str, str] = {}


_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16", "half": "f16", "f32": "f32",
           "float32": "f32", "float": "f32", "auto": None}


def _dtype(text: str) -> str | None:
    """--dtype in our spelling or vLLM's (auto: the backend's choice, as no flag)."""
    if text not in _DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from bf16, f16, f32, or vLLM's "
                                         "bfloat16, float16, half, float32, float, auto)")
    return _DTYPES[text]


def _positive(kind=int, zero: bool = False):
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'non-negative' if zero else 'positive'}, got {text}")
        return value
    return check


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m frontend", description="Serve a model over an OpenAI-compatible "
                                 "HTTP API. With no model flag it serves SmolLM2-135M-Instruct.")
    src = ap.add_argument_group("model")
    src.add_argument("--w", metavar="DIR", help="a local safetensors model folder (HF layout)")
    src.add_argument("--f", metavar="FILE", help="a local GGUF file; with --m, a file name in that hub repo")
    src.add_argument("--m", "--model", dest="m", metavar="ID", help="a Hugging Face model id (the local cache is "
                     "used when offline) or a local path (a GGUF file or a folder; --model as vLLM and llama-server "
                     "spell it)")
    src.add_argument("--served-model-name", "--alias", metavar="NAME", help="the model's name in /v1/models and in "
                     "requests (default: the id, folder or file name it was loaded by)")
    src.add_argument("--backend", choices=["auto", "mlx", "cuda"], default="auto",
                     help="auto: cuda when an NVIDIA GPU is usable, else mlx")
    src.add_argument("--dtype", type=_dtype, metavar="{bf16,f16,f32}", help="activations and unquantized weights "
                     "(default: the backend's choice; vLLM's bfloat16, float16 / half, float32 / float and auto too)")
    src.add_argument("--isq", metavar="TYPE", help="in-situ quantization: quantize the model's matrices at load to "
                     f"a GGUF block type, int4 (RTN groups of 128) or fp8 (e4m3, 128x128 block scales) "
                     f"({', '.join(ISQ_TYPES)}); the LM head as llama-quantize does (int4, fp8: kept as stored)")
    src.add_argument("--task", choices=TASKS, help="embed: serve the model for /v1/embeddings (pooled hidden states, "
                     "no LM head); auto (default): embed when its sentence-transformers files say so")
    src.add_argument("--runner", choices=list(RUNNER_TASKS), help="vLLM's spelling of --task (pooling: embed)")
    net = ap.add_argument_group("server")
    net.add_argument("--h", "--host", dest="h", metavar="HOST", default="127.0.0.1",
                     help="bind address (default 127.0.0.1)")
    net.add_argument("--p", "--port", dest="p", metavar="PORT", type=int, default=2000,
                     help="port (default 2000; --port as vLLM and llama-server spell it)")
    net.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 and tokenize")
    net.add_argument("--max-waiting", metavar="N", type=int, default=1024,
                     help="answer 429 when more than N requests wait (default 1024)")
    net.add_argument("--log", metavar="FILE", help="also write the log to FILE")
    net.add_argument("--on-engine-death", choices=["exit", "restart"], default="exit",
                     help="when the engine process dies (its requests fail, /health says 503): exit non-zero, or "
                     "start a new engine process (default exit)")
    net.add_argument("--engine-in-process", action="store_true", help="run the engine in a thread of the server's "
                     "process instead of a process of its own (debugging; the two share one GIL)")
    eng = ap.add_argument_group("engine")
    eng.add_argument("--mem", metavar="MiB", type=_positive(), help="KV cache budget in MiB (default: cuda 0.9 of "
                     "the free GPU memory, mlx 512)")
    eng.add_argument("--kv-fraction", metavar="F", type=float, help="KV budget as a share of the memory free "
                     "after loading and a warm-up step (0 < F <= 1)")
    eng.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                     help="auto: the activations' dtype; int8: K and V as 8-bit groups of 32 with a scale (MLX: and a "
                     "bias) each, about half the bytes a token of f16/bf16 (1.78x the tokens in the budget); fp8 "
                     "(CUDA only): K and V as e4m3 bytes with a scale a token and head (1 + 4 / head_dim bytes an "
                     "element: 1.94x the tokens at head_dim 128)")
    eng.add_argument("--block-size", metavar="N", type=_positive(), default=16, help="KV block size in tokens")
    eng.add_argument("--max-num-seqs", metavar="N", type=_positive(), default=64, help="sequences decoded together")
    eng.add_argument("--max-num-batched-tokens", metavar="N", type=_positive(), default=None,
                     help="tokens in one engine step (default: the backend's: 8192 on CUDA, as vLLM's server on a "
                     "large GPU, so that a burst of prompts is prefilled in few steps; 2048 elsewhere)")
    eng.add_argument("--max-model-len", metavar="N", type=_positive(), help="context limit (default: the model's)")
    eng.add_argument("--max-gen-tokens", metavar="N", type=_positive(),
                     help="default cap on generated tokens when a request gives no max_tokens")
    eng.add_argument("--prefill-chunk-size", metavar="N", type=_positive(), default=512, help="chunked prefill")
    eng.add_argument("--decode-step-tokens", metavar="N", type=_positive(zero=True), default=None,
                     help="while any stream waits for its next token, a step computes at most max(N, 1.5 x the "
                     "decoding streams, their count + 1/16 of the prompt tokens still to compute) tokens: new prompts "
                     "enter in pieces beside the decodes, each step costing about what a decode step does (bounds "
                     "the inter-token latency's tail). Default: off on every backend for now (no knee measured to pay "
                     "off through the server; 128 is an H200's to try); 0: off (--max-num-batched-tokens always)")
    eng.add_argument("--prefill-spread-steps", metavar="N", type=_positive(), default=16,
                     help="with the decode-step budget on, a step also takes 1/N of the prompt tokens still to "
                     "compute: a burst of prompts is spread over about N steps, and a prompt waits about N steps")
    eng.add_argument("--prefill-burst-tokens", metavar="N", type=_positive(zero=True), default=None,
                     help="when at least N prompt tokens wait while streams decode, the steps that follow compute "
                     "those prompts first, decodes paused until they are done (each running stream then waits one "
                     "long gap per burst instead of one per step of it); smaller arrivals ride beside the decodes. "
                     "Default: the backend's (off on every backend for now); 0: off")
    eng.add_argument("--disable-prefix-cache", action="store_true", help="no automatic prefix caching")
    eng.add_argument("--disable-cuda-graph", "--enforce-eager", dest="disable_cuda_graph", action="store_true",
                     help="CUDA backend: run decode steps eagerly (--enforce-eager as vLLM spells it)")
    eng.add_argument("--disable-async-scheduling", action="store_true", help="CUDA backend: read each step's "
                     "tokens back before launching the next (by default steps overlap the host's work)")
    eng.add_argument("--d", metavar="ID[,ID...]", help="CUDA backend: the GPU to use (default 0), or several: tensor "
                     "parallel, one process per GPU (a power of two up to 8). Under torchrun or an MPI launcher each "
                     "rank takes its LOCAL_RANK's GPU instead")
    eng.add_argument("--tp", metavar="N", type=_positive(), help="MLX backend: tensor parallel over N local processes "
                     "(a power of two up to 8) joined by mx.distributed's ring on 127.0.0.1; implies --backend mlx "
                     "(the CUDA backend's ranks are its --d GPUs)")
    # Test only: the CUDA backend on CPU tensors (Triton's interpreter), one process per --d id, gloo between them.
    eng.add_argument("--cpu-tensors", action="store_true", help=argparse.SUPPRESS)
    smp = ap.add_argument_group("sampling defaults (a request's own values win)")
    smp.add_argument("--temperature", type=float, default=1.0)
    smp.add_argument("--top-p", type=float, default=1.0)
    smp.add_argument("--top-k", type=int, default=0)
    smp.add_argument("--min-p", type=float, default=0.0)
    smp.add_argument("--frequency-penalty", type=float, default=0.0)
    smp.add_argument("--presence-penalty", type=float, default=0.0)
    one = ap.add_argument_group("one-shot")
    one.add_argument("--prompt", help="answer this chat message, print it and exit instead of serving")
    one.add_argument("--system", help="a system prompt for --prompt (refused when serving: a request brings its "
                     "own system message)")
    one.add_argument("--max-tokens", type=_positive(), help="tokens to generate for --prompt (default 256; refused "
                     "when serving: --max-gen-tokens is the default there)")
    one.add_argument("--seed", type=int, help="with --prompt, its seed; when serving, the engine's seed (as "
                     "vLLM's): requests without a seed of their own draw from streams derived from it")
    from frontend.chat_output import ParserChoice
    from frontend.limits import ServingLimits
    ParserChoice.add_flags(ap)
    ServingLimits.add_flags(ap, _positive())
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    for name, why in NOT_YET.items():
        if getattr(args, name) not in (None, False):
            ap.error(why)
    if args.isq is not None:
        try:
            isq_kind(args.isq)
        except ValueError as e:
            ap.error(str(e))
    if args.kv_fraction is not None and not 0 < args.kv_fraction <= 1:
        ap.error(f"--kv-fraction must be in (0, 1], got {args.kv_fraction}")
    if args.mem and args.kv_fraction:
        ap.error("give the KV budget with --mem or --kv-fraction, not both")
    if args.d is not None:
        args.d = device_ids(ap, args.d)
    if args.cpu_tensors:
        args.backend = "cuda"
    if args.d is not None and len(args.d) > 1 and args.backend == "mlx":
        ap.error("tensor parallel on the MLX backend is --tp N; its --d takes no GPU ids")
    if args.tp is not None:
        if args.backend == "cuda" or args.d is not None:
            ap.error("--tp N is the MLX backend's tensor parallel; the CUDA backend's ranks are its GPUs: --d 0,1")
        check_flag_world(ap, "--tp", args.tp, "processes")
        args.backend = "mlx"
    if args.kv_cache_dtype != "auto" and args.backend != "auto":
        try:
            kv_cache_quant(args.kv_cache_dtype, args.backend)
        except (ValueError, NotImplementedError) as e:
            ap.error(str(e))
    args.launch = launcher_rank(ap, args)
    args.mlx_ring = mlx_launch_rank(ap, args)
    if args.w and (args.f or args.m):
        ap.error("--w names a local folder; it cannot be combined with --f or --m")
    from frontend.protocol import SamplingFields, ServerDefaults, sampling_params
    try:
        args.defaults = ServerDefaults(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                       min_p=args.min_p, presence_penalty=args.presence_penalty,
                                       frequency_penalty=args.frequency_penalty, max_gen_tokens=args.max_gen_tokens)
        sampling_params(SamplingFields(), args.defaults, 1, None)  # the engine's own range checks, at start-up
    except ValueError as e:
        ap.error(f"sampling default: {e}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        ap.error("--seed must be in [0, 2**63)")
    if args.max_waiting < 0:
        ap.error("--max-waiting must be >= 0")
    if args.task and args.runner and task_of(args.runner) != args.task:
        ap.error(f"--task {args.task} and --runner {args.runner} disagree; give one")
    args.task = task_of(args.runner) if args.runner else args.task or "auto"
    if args.engine_in_process and args.on_engine_death == "restart":
        ap.error("--on-engine-death restart needs the engine in its own process (not --engine-in-process)")
    if args.prompt is None:  # serving: one-shot flags that would be silently ignored are refused
        if args.system is not None:
            ap.error("--system applies to --prompt only; when serving, each request gives its own system message")
        if args.max_tokens is not None:
            ap.error("--max-tokens applies to --prompt only; when serving, --max-gen-tokens sets the default "
                     "for requests without max_tokens")
    return args


def setup_logging(log_file: str | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers, force=True)
    # Sanic's access records carry their fields as extras (host, request, status, byte), not in the message.
    access = logging.getLogger("sanic.access")
    access.propagate = False
    fmt = logging.Formatter("%(asctime)s access %(host)s %(request)s %(status)s %(byte)s")
    for h in handlers:
        twin = logging.FileHandler(h.baseFilename) if isinstance(h, logging.FileHandler) else \
            logging.StreamHandler(sys.stderr)
        twin.setFormatter(fmt)
        access.addHandler(twin)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log)
    from frontend.engine_proc.spec import LOAD_ERRORS

    engine = None
    try:
        source = resolve(args.w, args.f, args.m)
        if args.launch is not None and args.launch.rank != 0:  # a launcher's worker rank: rank 0 serves
            return _serve_rank(args, str(source.path))
        if args.mlx_ring is not None and args.mlx_ring.rank != 0:
            return _serve_mlx_rank(args, str(source.path))
        name = args.served_model_name or source.id  # what /v1/models lists and requests give
        log.info("loading %s from %s", name, source.path)
        spec = engine_spec(args, str(source.path))
        if args.prompt is not None or args.engine_in_process:  # else the engine process loads the weights
            engine = spec.load()
    except LOAD_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompt is not None:
        if engine.pooler is not None:
            print("error: this is an embedding model (no LM head): --prompt generates text; serve it and use "
                  "/v1/embeddings", file=sys.stderr)
            return 2
        return answer_once(engine, args)
    from frontend.run_server import serve
    return serve(args, name, spec, engine)


def engine_spec(args: argparse.Namespace, model_path: str):
    """What the engine (in its process or this one) is built from: the model, backend, engine config and --isq."""
    from frontend.engine_proc.spec import EngineSpec

    return EngineSpec(model_path, args.backend, backend_options(args), engine_config(args), args.log, isq=args.isq,
                      task=args.task)


def _serve_rank(args: argparse.Namespace, path: str) -> int:
    """A rank other than 0 of a torchrun/MPI launch: its shard, driven by rank 0 until rank 0 stops."""
    from backends.cuda.tensor_parallel import worker_main

    opts = backend_options(args)
    device, rv = opts.pop("device")[0], opts.pop("rendezvous")
    log.info("rank %d of %d on %s, serving rank 0's steps", rv.rank, rv.world, device)
    worker_main({"model": path, "isq": args.isq, "task": args.task, "rendezvous": rv, "device": device,
                 "options": opts})
    return 0


def _serve_mlx_rank(args: argparse.Namespace, path: str) -> int:
    """A rank other than 0 of an mlx.launch ring: its shard, driven by rank 0 until rank 0 stops."""
    from backends.mlx.tensor_parallel import worker_main

    opts = backend_options(args)
    ring = opts.pop("ring")
    log.info("rank %d of %d of MLX's ring, serving rank 0's steps", ring.rank, ring.world)
    worker_main({"model": path, "isq": args.isq, "task": args.task, "ring": ring, "options": opts})
    return 0


def engine_config(args: argparse.Namespace):
    from frontend.engine.engine import EngineConfig
    from frontend.engine.scheduler import SchedulerConfig

    return EngineConfig(block_size=args.block_size, kv_cache_bytes=args.mem * 2**20 if args.mem else None,
                        kv_fraction=args.kv_fraction, max_model_len=args.max_model_len,
                        prefix_caching=not args.disable_prefix_cache,
                        async_scheduling=not args.disable_async_scheduling, seed=args.seed,
                        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                  args.prefill_chunk_size, args.decode_step_tokens,
                                                  prefill_spread_steps=args.prefill_spread_steps,
                                                  prefill_burst_tokens=args.prefill_burst_tokens))


def backend_options(args: argparse.Namespace) -> dict:
    out = {"dtype": args.dtype} if args.dtype else {}
    if args.kv_cache_dtype != "auto":
        out["kv_cache_dtype"] = args.kv_cache_dtype
    if args.disable_cuda_graph:
        out["cuda_graph"] = False
    ids = [args.launch.local_rank] if args.launch is not None else args.d
    if ids is not None or args.cpu_tensors:
        devices = ["cpu" if args.cpu_tensors else f"cuda:{i}" for i in ids or [0]]
        out["device"] = devices[0] if len(devices) == 1 and args.launch is None else devices
    if args.launch is not None:
        out["rendezvous"] = args.launch
    if getattr(args, "tp", None) and args.tp > 1:
        out["tp"] = args.tp
    if getattr(args, "mlx_ring", None) is not None:
        out["ring"] = args.mlx_ring
    return out


def answer_once(engine, args: argparse.Namespace) -> int:
    """--prompt: one chat answer through the engine, streamed to stdout."""
    from frontend.protocol import SamplingFields, sampling_params

    tok = engine.tokenizer
    if tok is None:
        print("error: this model has no tokenizer", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages) if tok.chat_template else tok.encode(args.prompt)
    params = sampling_params(SamplingFields(seed=args.seed), args.defaults, args.max_tokens or 256, None)
    start = time.perf_counter()
    engine.add_request(ids, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            print(out.outputs[0].delta_text, end="", flush=True)
            final = out
    print()
    log.info("%d tokens in %.1f s (%s)", len(final.outputs[0].token_ids), time.perf_counter() - start,
             final.outputs[0].finish_reason)
    return 0
