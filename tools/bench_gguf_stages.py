"""The measuring stages of tools.bench_gguf: llama.cpp's tools on each GGUF file, then our engine on the same files
(loaded by ir.loader, run by the CUDA backend through LLMEngine, timed by tools.bench_gpu's decode_rate and
prefill_rate)."""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict
from pathlib import Path

from tools.bench_gguf import GEN, PREFILL, PROMPT, Figure, Stage, say

BLOCK = 16


# --- llama.cpp --------------------------------------------------------------------------------------------------

def stage_llamacpp(args: argparse.Namespace) -> None:
    """Batch 1 decode from llama-bench (tg128 at depth = the context), prefill from llama-bench pp2048, larger
    batches from llama-batched-bench (S_TG); batch 1 is measured by llama-batched-bench too (side
    "llamacpp_batched") whenever it runs at that context anyway."""
    from tools.llama_cpp import LlamaCppError, locate

    st = Stage(args, "llamacpp")
    st.begin()
    lc = locate(args.llama_cpp)
    st.results.data["env"]["llama_cpp"] = str(lc.bindir)
    for file in args.files:
        figs = [f for f in st.figures if f.file == file]
        path = st.path(file)
        if not figs:
            continue
        if not path.exists():
            st.results.error(f"{file}: missing", FileNotFoundError(f"{path}: run --stage prepare --files {file} first"))
            continue
        st.note_file(file)
        for what, job in llama_jobs(figs, path, args):
            if st.left() < 20:
                st.results.error(f"{file}: {what}", TimeoutError("skipped: out of this stage's budget"))
                continue
            say(f"  llama.cpp {file}: {what}")
            t = time.perf_counter()
            try:
                for fig, side, rec in job(lc, st.left()):
                    st.results.put(fig, side, rec)
                    say(f"    {fig.key}: {rec['tok_s']:,.1f} tok/s ({rec['tool']})")
            except LlamaCppError as e:
                st.results.error(f"{file}: {what}", e)
            say(f"    ({time.perf_counter() - t:.0f} s)")
    st.end()


def llama_jobs(figs: list[Figure], path: Path, args: argparse.Namespace) -> list[tuple[str, object]]:
    """(description, job(llama_cpp, timeout) -> [(figure, side, record)]) for one file's figures."""
    jobs = []
    b1 = {f.context: f for f in figs if f.kind == "decode" and f.batch == 1}
    if b1:
        def tg(lc, timeout, b1=b1):
            rows = lc.bench(path, prompts=(), gens=(GEN,), depths=tuple(sorted(b1)), reps=args.reps, timeout=timeout)
            return [(b1[r.n_depth], "llamacpp", {"tok_s": r.avg_ts, "stddev": r.stddev_ts, "reps": r.reps,
                                                 "tool": f"llama-bench {r.test}"}) for r in rows if r.n_depth in b1]
        jobs.append((f"llama-bench tg{GEN} at depths {sorted(b1)}", tg))
    pre = [f for f in figs if f.kind == "prefill"]
    if pre:
        def pp(lc, timeout, fig=pre[0]):
            rows = lc.bench(path, prompts=(fig.context,), gens=(), reps=args.reps, timeout=timeout)
            return [(fig, "llamacpp", {"tok_s": r.avg_ts, "stddev": r.stddev_ts, "reps": r.reps,
                                       "tool": f"llama-bench {r.test}"}) for r in rows]
        jobs.append((f"llama-bench pp{PREFILL}", pp))
    by_ctx: dict[int, dict[int, Figure]] = defaultdict(dict)
    for f in figs:
        if f.kind == "decode":
            by_ctx[f.context][f.batch] = f
    for ctx, by_batch in sorted(by_ctx.items()):
        if max(by_batch) == 1:
            continue  # llama-bench has it
        shared = ctx > PROMPT and not args.no_shared_prompt

        def batched(lc, timeout, ctx=ctx, by_batch=by_batch, shared=shared):
            rows = lc.batched_bench(path, ctx, GEN, tuple(sorted(by_batch)), shared_prompt=shared, timeout=timeout)
            return [(by_batch[r.pl], "llamacpp_batched" if r.pl == 1 else "llamacpp",
                     {"tok_s": r.speed_tg, "prefill_tok_s": r.speed_pp, "t_tg": r.t_tg,
                      "tool": f"llama-batched-bench npp {r.pp} ntg {r.tg} npl {r.pl}" + (" -pps" if shared else "")})
                    for r in rows if r.pl in by_batch]
        jobs.append((f"llama-batched-bench context {ctx}, batches {sorted(by_batch)}", batched))
    return jobs


# --- ours -------------------------------------------------------------------------------------------------------

def engine_over(backend, max_batch: int, max_len: int):
    """An engine over `backend` sized for `max_batch` sequences of `max_len` tokens, as bench_gpu's engine_for
    sizes it, and allowed contexts past the file's trained length (the 32k curve point plus its 128 new tokens)."""
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.gc_pauses import freeze_startup
    from frontend.engine.scheduler import SchedulerConfig

    blocks = max_batch * (-(-max_len // BLOCK) + 1) + 64
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=blocks, prefix_caching=False, async_scheduling=True,
                          max_model_len=max_len,
                          scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=4096,
                                                    prefill_chunk_size=4096, decode_step_tokens=0))
    engine = LLMEngine(backend, config)
    freeze_startup()  # as the server does after loading (frontend/engine/gc_pauses.py)
    return engine


def engine_groups(figs: list[Figure]) -> dict[int, list[Figure]]:
    """One engine per context (the prefill rides with the 128-token one), figures by batch size."""
    groups: dict[int, list[Figure]] = defaultdict(list)
    for f in figs:
        groups[PROMPT if f.kind == "prefill" else f.context].append(f)
    return {c: sorted(g, key=lambda f: (f.kind == "prefill", f.batch)) for c, g in sorted(groups.items())}


def seconds_needed(fig: Figure) -> float:
    """A generous guess, to skip a figure rather than be cut off inside it: prefill of every prompt at ~5k tok/s."""
    return 15 + fig.batch * fig.context / 5000


def stage_ours(args: argparse.Namespace) -> None:
    import torch

    from tools.bench_gpu_rates import copy_bandwidth

    if not torch.cuda.is_available():
        raise SystemExit("--stage ours needs a CUDA GPU")
    st = Stage(args, "ours")
    st.begin()
    env = st.results.data["env"]
    env.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=copy_bandwidth())
    if args.mmq:
        env["mmq"] = f"{args.mmq[0]}:{args.mmq[1] or 'default'}"
    torch.cuda.empty_cache()  # the copy's 4 GiB go back before the model comes
    say(f"  {env['gpu']}: copy {env['copy_gbs']:,.0f} GB/s")
    st.results.save()
    for file in args.files:
        figs = [f for f in st.figures if f.file == file]
        if figs and not st.path(file).exists():
            st.results.error(f"{file}: missing", FileNotFoundError(f"{st.path(file)}: run --stage prepare first"))
        elif figs:
            st.note_file(file)
            _ours_file(st, file, figs)
        gc.collect()
        torch.cuda.empty_cache()
    st.end()


def _ours_file(st: Stage, file: str, figs: list[Figure]) -> None:
    import torch

    from backends.cuda.backend import CUDABackend
    from ir.loader import load_model

    t = time.perf_counter()
    model = load_model(st.path(file), progress=False)
    # the GGUF default: f16 compute, llama.cpp's
    backend = CUDABackend(model, progress=False, kv_cache_dtype=st.args.kv_cache_dtype)
    if st.args.mmq:  # before the engine's graphs are captured
        backend.runner.mmq_variant = st.args.mmq[0]
        backend.runner.mmq_max_rows = st.args.mmq[1] or backend.runner.mmq_max_rows
    info = st.results.data["files"][file]
    info.update(ours_load_s=time.perf_counter() - t, ours_resident_bytes=backend.memory().weights_bytes,
                ours_backend=backend.describe())
    say(f"  ours {file}: {backend.describe()}, {info['ours_resident_bytes'] / 1e9:.2f} GB resident, loaded in "
        f"{info['ours_load_s']:.0f} s")
    st.results.save()
    vocab = model.config.vocab_size
    for ctx, group in engine_groups(figs).items():
        group = [f for f in group if _room(st, f)]
        if not group:
            continue
        decodes = [f for f in group if f.kind == "decode"]
        max_batch = max((f.batch for f in decodes), default=1)
        max_len = max([f.context + GEN for f in decodes] + [PREFILL + 1 for f in group if f.kind == "prefill"])
        try:
            engine = engine_over(backend, max_batch, max_len)
        except Exception as e:  # noqa: BLE001  (an engine that does not fit: the next context may)
            st.results.error(f"{file}: engine for context {ctx}", e)
            continue
        for fig in group:
            # A failed figure may leave requests in the engine: the rest of its group waits for a new engine.
            if not _room(st, fig) or not _measure(st, engine, fig, vocab, f"max_num_seqs {max_batch}, "
                                                  f"max_model_len {max_len}"):
                break
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def _room(st: Stage, fig: Figure) -> bool:
    if st.left() >= seconds_needed(fig):
        return True
    st.results.error(f"{fig.file}: {fig.key}", TimeoutError(f"skipped: {st.left():.0f} s left of the stage's budget"))
    return False


def _measure(st: Stage, engine, fig: Figure, vocab: int, sizing: str) -> bool:
    from tools.bench_gpu_rates import decode_rate, prefill_rate

    t = time.perf_counter()
    try:
        if fig.kind == "decode":
            v = decode_rate(engine, fig.batch, fig.context, GEN, vocab)
        else:
            v = prefill_rate(engine, fig.context, vocab)
    except Exception as e:  # noqa: BLE001  (recorded; the other figures still run)
        st.results.error(f"{fig.file}: {fig.key}", e)
        return False
    st.results.put(fig, "ours", {"tok_s": v, "tool": f"LLMEngine over CUDABackend ({sizing})",
                                 "seconds": time.perf_counter() - t})
    say(f"    {fig.key}: {v:,.1f} tok/s ({time.perf_counter() - t:.0f} s)")
    return True
