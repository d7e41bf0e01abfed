#!/usr/bin/env python3
"""Sweep the fused MoE over GGUF stacks on a CUDA GPU: `python -m tools.sweep_moe [--tokens 1,16,256] [--layers 8]`.

At Qwen3-30B-A3B's layer shape (128 experts of 768 x 2048, top 8; gate/up Q4_K and down Q6_K, as Q4_K_M keeps
them), bf16 x, random routings: each pass (gated, down) at every (block_m, block_n, num_warps) the tile rules could
pick, timed with do_bench_cudagraph over `layers` copies of the stacks so that no expert stays in L2; then the
launcher's own choice end to end, against the per-expert loop it replaced (tokens grouped on the host, each
expert's rows through dequant_gemv / mmq / dequant_matmul as linears.quant_linear picks) and the dense bf16 fused
MoE; up to GEMV_TOKENS tokens, both paths of the launcher forced (grouped, and a GEMV a slot: kernels_src/moe_gemv.py),
GGUF and dense, to place moe_gemv.GEMV_SLOTS (--variants blocked,i8: the GGUF GEMV on int8 x too, moe_gemv.I8;
`--tokens 1,8,16 --no-sweep --variants blocked,i8` times it against fp x). GB/s counts the routed experts' blocks
(or bf16 rows) once.
--dequant times only the grouped path over GGUF stacks two ways, at --tokens (default 64,256,2048): the grouped GGUF
kernel against experts dequantized a chunk at a time and the dense kernel (kernels_src/moe_dequant.py), beside the
dequantization alone and the dense bf16 grouped kernel, to place moe_dequant.DEQUANT_SLOTS_PER_EXPERT.
--variants blocked,mmq times only the grouped passes on int8 tensor cores (kernels_src/moe_mmq.py) against the GEMV,
dequantize + dense and grouped GGUF paths, at --tokens (default 16,32,64,128,256), as a table
(tools/sweep_moe_mmq.py), to place moe_mmq.MMQ, MMQ_SLOTS_PER_EXPERT and TILES."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from types import SimpleNamespace

H, INNER, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B's MoE layer
GEMV_TOKENS = 32  # both paths timed up to this batch (256 slots: moe_gemv.GGUF_GEMV_SLOTS)
DEQUANT_TOKENS = "64,256,2048"  # --dequant's batches: 512, 2,048 and 16,384 slots (a prefill of 2,048 tokens)
MMQ_TOKENS = "16,32,64,128,256"  # the mmq variant's: 128 to 2,048 slots, 1 to 16 an expert


def _bench(fn, graph: bool = True) -> float:
    """Seconds a call, the median of repeated runs (replayed from a CUDA graph unless graph is False)."""
    import triton.testing

    run = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
    return run(fn, rep=20, return_mode="median") / 1e3


def _layers(torch, n: int, tokens: int, quant: bool):
    """n layers of (gate, up, down) stacks (GGUFStack of random valid blocks, or bf16), each with its own routing."""
    from kernels_src import moe_gguf
    from tools.kernel_case_base import SPREAD, gguf_weights

    d = SimpleNamespace(torch=torch, dev="cuda", gen=torch.Generator("cuda").manual_seed(0))
    out = []
    for _ in range(n):
        if quant:
            stacks = [moe_gguf.GGUFStack(gguf_weights(d, q, E * rows, k, 1 / (SPREAD[q] * k ** 0.5)), q, (E, rows, k))
                      for q, rows, k in (("Q4_K", INNER, H), ("Q4_K", INNER, H), ("Q6_K", H, INNER))]
        else:
            stacks = [torch.randn((E, rows, k), device="cuda", generator=d.gen).bfloat16() * k ** -0.5
                      for rows, k in ((INNER, H), (INNER, H), (H, INNER))]
        ids = torch.rand((tokens, E), device="cuda", generator=d.gen).argsort(-1)[:, :K].to(torch.int32)
        weights = torch.softmax(torch.randn((tokens, K), device="cuda", generator=d.gen), -1)
        out.append((stacks, ids, weights))
    return out


def _active_bytes(stacks, ids, passes=(0, 1, 2)) -> int:
    used = int(ids.unique().numel())
    return sum(used * (s.data.shape[0] // E) * s.data.shape[1] if hasattr(s, "qtype")
               else used * s.shape[1] * s.shape[2] * 2 for i, s in enumerate(stacks) if i in passes)


def sweep_passes(torch, layers, tokens: int, variants=("blocked",)) -> list[dict]:
    """Each pass alone at each tile choice and variant (words: Q4_K / Q5_K headers as 32-bit words, for the passes
    it changes, checked against blocked's output at the same tiles): us a layer and GB/s of its routed blocks."""
    from kernels_src import moe, moe_gguf

    x = torch.randn((tokens, H), device="cuda").bfloat16()
    s = tokens * K
    hidden = torch.randn((s, INNER), device="cuda").bfloat16()
    y, h_out = torch.empty((s, H), device="cuda", dtype=torch.bfloat16), torch.empty_like(hidden)
    rule_m = moe.default_tiles(s, E)[0]
    rows_out = []
    for block_m in sorted({rule_m, 16, 64}):
        if block_m == 64 and s < 8 * E:
            continue  # tall tiles of padding only
        aligned = [moe.moe_align(ids, E, block_m) for _, ids, _ in layers]
        for gated, block_n, warps, variant in itertools.product((True, False), (16, 32, 64), (4, 8), variants):
            if variant == "i8" or variant == "words" and not gated:  # i8: the GEMV path's, timed end to end
                continue  # the down stacks are Q6_K: words changes nothing there

            def run(block_n=block_n, warps=warps, gated=gated, block_m=block_m, aligned=aligned, variant=variant,
                    n=None):
                for (stacks, _, w), (rows, be) in zip(layers[:n], aligned, strict=False):
                    a, b = (stacks[0], stacks[1]) if gated else (stacks[2], stacks[2])
                    moe_gguf.launch(x if gated else hidden, a, b, h_out if gated else y, rows, be, w.reshape(-1), s,
                                    H if gated else INNER, gated=gated, top_k=K, act="silu", block_m=block_m,
                                    block_n=block_n, target="triton", pdl=True, num_warps=warps,
                                    words=variant == "words")
                return h_out if gated else y

            diff = None
            if variant == "words":  # the same tiles' blocked output on the first layer: the decoding must agree
                want = run(variant="blocked", n=1).float().clone()
                diff = float((run(n=1).float() - want).abs().max() / want.abs().max())
            t = _bench(run) / len(layers)
            nbytes = sum(_active_bytes(st, ids, (0, 1) if gated else (2,)) for st, ids, _ in layers) / len(layers)
            q = ("Q4_K",) if gated else ("Q6_K",)
            rule = (block_m == rule_m and (block_n, warps) == moe_gguf.pass_tiles(q, gated, block_m,
                                                                                   moe.default_tiles(s, E)[1]))
            rows_out.append(dict(tokens=tokens, gated=gated, block_m=block_m, block_n=block_n, warps=warps,
                                 variant=variant, us=t * 1e6, gbs=nbytes / t / 1e9, rule=rule, diff=diff))
    return rows_out


def _per_expert(runner, x, weights, ids, gate, up, down):
    """The loop the fused kernel replaced: tokens grouped on the host, each expert through the quantized GEMMs."""
    import torch

    from backends.cuda.weights import QuantWeight

    def expert(st, e):
        rows = st.shape[1]
        return QuantWeight(st.data[e * rows:(e + 1) * rows], st.qtype, st.shape[1:])

    t, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    out = torch.zeros((t, H), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        slots = order[start:start + n]
        start += n
        tok = slots // k
        xe = x.index_select(0, tok)
        h = torch.nn.functional.silu(runner.linear(xe, expert(gate, e))) * runner.linear(xe, expert(up, e))
        out.index_add_(0, tok, runner.linear(h, expert(down, e)) * weights.reshape(-1)[slots, None].to(x.dtype))
    return out


def end_to_end(torch, layers, dense, tokens: int, gemv_tokens: int = GEMV_TOKENS, variants=("blocked",)) -> dict:
    from backends.cuda import x_int8_fusion
    from backends.cuda.runner import MMQ_MAX_ROWS, Runner
    from kernels_src import moe, moe_gguf

    x = torch.randn((tokens, H), device="cuda").bfloat16()
    runner = object.__new__(Runner)  # only its quantized linear: target, pdl and the row-id cache
    runner.target, runner.pdl, runner._rows, runner.device = "triton", None, {}, x.device
    runner.mmq_variant, runner.mmq_max_rows = None, MMQ_MAX_ROWS
    runner.x_int8_plan = x_int8_fusion.Plan()  # no norm before these linears: each quantizes its own x

    def fused(ls, gemv=None):
        for stacks, ids, w in ls:
            moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=gemv)

    def loop():
        for stacks, ids, w in layers:
            _per_expert(runner, x, w, ids, *stacks)

    want = _per_expert(runner, x, layers[0][2], layers[0][1], *layers[0][0]).float()
    got = moe.moe_experts(x, layers[0][2], layers[0][1], *layers[0][0], target="triton").float()
    n = len(layers)
    res = dict(tokens=tokens, max_rel_diff=float((got - want).abs().max() / want.abs().max()),
               fused_us=_bench(lambda: fused(layers)) / n * 1e6, fused_eager_us=_bench(lambda: fused(layers), False)
               / n * 1e6, loop_us=_bench(loop, False) / n * 1e6,
               dense_us=_bench(lambda: fused(dense)) / len(dense) * 1e6)
    res["gbs"] = sum(_active_bytes(*ls[:2]) for ls in layers) / n / (res["fused_us"] / 1e6) / 1e9
    res["dense_gbs"] = sum(_active_bytes(*ls[:2]) for ls in dense) / len(dense) / (res["dense_us"] / 1e6) / 1e9
    if tokens <= gemv_tokens:
        for path, gemv in (("grouped", False), ("gemv", True)):
            res[f"{path}_us"] = _bench(lambda gemv=gemv: fused(layers, gemv)) / n * 1e6
            res[f"dense_{path}_us"] = _bench(lambda gemv=gemv: fused(dense, gemv)) / len(dense) * 1e6
    if "i8" in variants and tokens <= gemv_tokens:  # the GEMV path on int8 x (moe_gemv.I8); gemv_us: on fp x
        from kernels_src import moe_gemv

        fp = moe.moe_experts(x, layers[0][2], layers[0][1], *layers[0][0], target="triton", gemv=True).float()
        was, moe_gemv.I8 = moe_gemv.I8, True
        try:
            got = moe.moe_experts(x, layers[0][2], layers[0][1], *layers[0][0], target="triton", gemv=True).float()
            res["i8_max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
            res["i8_vs_fp_rel_diff"] = float((got - fp).abs().max() / fp.abs().max())
            res["i8_gemv_us"] = _bench(lambda: fused(layers, True)) / n * 1e6
        finally:
            moe_gemv.I8 = was
    if "words" in variants:  # the launcher with moe_gguf.WORDS on: its choice, and the grouped path forced
        was, moe_gguf.WORDS = moe_gguf.WORDS, True
        try:
            words = moe.moe_experts(x, layers[0][2], layers[0][1], *layers[0][0], target="triton", gemv=False)
            res["words_max_rel_diff"] = float((words.float() - want).abs().max() / want.abs().max())
            res["words_us"] = _bench(lambda: fused(layers)) / n * 1e6
            res["words_grouped_us"] = _bench(lambda: fused(layers, False)) / n * 1e6
        finally:
            moe_gguf.WORDS = was  # the default (on since 2026-12-03) for the next batch's runs
    return res


def dequant_ab(torch, layers, dense, tokens: int) -> dict:
    """The grouped path over the GGUF layers, us a layer: grouped GGUF (moe_gguf) against dequantize + grouped dense
    (moe_dequant, at its warps and at 4), the dequantization of all three stacks alone, and the dense bf16 stacks;
    the two GGUF paths' outputs compared."""
    from kernels_src import moe, moe_dequant
    from kernels_src.dequantize import dequantize_rows

    x = torch.randn((tokens, H), device="cuda").bfloat16()

    def fused(ls, **kw):
        for stacks, ids, w in ls:
            moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=False, **kw)

    bufs = [torch.empty(st.shape, dtype=x.dtype, device="cuda") for st in layers[0][0]]
    row_ids = [torch.arange(st.data.shape[0], dtype=torch.int32, device="cuda") for st in layers[0][0]]

    def dequantize_only():
        for stacks, _, _ in layers:
            for st, buf, r in zip(stacks, bufs, row_ids, strict=True):
                dequantize_rows(st.data, r, st.qtype, st.shape[2], out=buf.view(-1, st.shape[2]), target="triton")

    stacks, ids, w = layers[0]
    want = moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=False, dequant=False).float()
    got = moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=False, dequant=True).float()
    n = len(layers)
    res = dict(tokens=tokens, slots=tokens * K, max_rel_diff=float((got - want).abs().max() / want.abs().max()),
               grouped_gguf_us=_bench(lambda: fused(layers, dequant=False)) / n * 1e6,
               dequant_us=_bench(lambda: fused(layers, dequant=True)) / n * 1e6,
               dequantize_only_us=_bench(dequantize_only) / n * 1e6,
               dense_us=_bench(lambda: fused(dense)) / len(dense) * 1e6)
    wide = moe_dequant.WIDE_WARPS
    moe_dequant.WIDE_WARPS = 4  # the gated pass at 64 x 64 tiles as the dense stacks' pass runs it (spills)
    try:
        res["dequant_w4_us"] = _bench(lambda: fused(layers, dequant=True)) / n * 1e6
    finally:
        moe_dequant.WIDE_WARPS = wide
    return res


def gemv_tiles(torch, layers, tokens: int) -> list[dict]:
    """The GEMV path over GGUF stacks (moe_gemv.moe_qgemv_kernel: a program takes ROWS rows of one slot's expert) with
    one pass's ROWS, STEP and num_warps swept around moe_gemv._gguf_tiles' rule (taken from dequant_gemv's, which times
    the plain GEMV, not this one), the other pass at the rule's: us a layer, and the output's difference from the
    rule's (a tile that decodes wrongly shows there)."""
    from kernels_src import moe, moe_gemv

    x = torch.randn((tokens, H), device="cuda").bfloat16()
    rule = moe_gemv._gguf_tiles
    st, slots = layers[0][0], tokens * K
    rules = {True: rule(st[0], st[1], True, slots), False: rule(st[2], st[2], False, slots)}

    def run(n=None):
        for stacks, ids, w in layers[:n]:
            out = moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=True)
        return out

    want = run(1).float().clone()
    out = []
    for gated, rows, step, warps in itertools.product((True, False), (1, 2, 4), (2, 4, 8), (1, 2)):
        pick = dict(ROWS=rows, STEP_A=step, STEP_B=step, num_warps=warps)

        def tiles(a, b, g, slots=1, *, gated=gated, pick=pick):
            return rule(a, b, g, slots) | (pick if g == gated else {})

        moe_gemv._gguf_tiles = tiles
        try:
            diff = float((run(1).float() - want).abs().max() / want.abs().max())
            us = _bench(run) / len(layers) * 1e6
        except Exception as e:  # noqa: BLE001  (a tile the kernel cannot build: reported, the sweep goes on)
            diff, us = f"{type(e).__name__}: {str(e)[:80]}", float("inf")
        finally:
            moe_gemv._gguf_tiles = rule
        r = rules[gated]
        out.append(dict(tokens=tokens, gated=gated, rows=rows, step=step, warps=warps, us=us, diff=diff,
                        rule=(rows, step, warps) == (r["ROWS"], r["STEP_A"], r["num_warps"])))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", help="batches (default 1,4,16,64,256,1024,4096; with --dequant "
                    f"{DEQUANT_TOKENS})")
    ap.add_argument("--dequant", action="store_true", help="only the grouped GGUF kernel against dequantize + "
                    "grouped dense (moe_dequant), at each batch")
    ap.add_argument("--layers", type=int, default=8, help="copies of the stacks cycled through (Q4_K_M: ~0.4 GB each)")
    ap.add_argument("--no-sweep", action="store_true", help="end to end only")
    ap.add_argument("--gemv-tiles", action="store_true", help="only the GEMV path's tiles, a pass at a time, at each "
                    "batch (default 1,8): moe_gemv._gguf_tiles' rule against ROWS x STEP x num_warps")
    ap.add_argument("--gemv-tokens", type=int, default=GEMV_TOKENS, help="both paths timed up to this batch "
                    f"(default {GEMV_TOKENS})")
    ap.add_argument("--variants", default="blocked", help="the grouped kernel's variants, comma-separated: blocked, "
                    "words (Q4_K / Q5_K headers as 32-bit words; moe_gguf.WORDS); i8: the GEMV path on int8 x too "
                    "(moe_gemv.I8), up to --gemv-tokens; mmq: only the grouped passes on int8 tensor cores "
                    "(moe_mmq) against the other paths, a table")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "sweep_moe.json")
    args = ap.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if not variants or set(variants) - {"blocked", "words", "i8", "mmq"}:
        ap.error(f"--variants: blocked, words, i8 and/or mmq, not {args.variants!r}")
    import torch

    from tools import sweep_moe_mmq

    res: dict = {"gpu": torch.cuda.get_device_name(), "passes": [], "end_to_end": [], "dequant": [], "gemv_tiles": [],
                 "mmq": []}
    tokens_list = args.tokens or (DEQUANT_TOKENS if args.dequant else "1,8" if args.gemv_tiles
                                  else MMQ_TOKENS if "mmq" in variants else "1,4,16,64,256,1024,4096")
    if "mmq" in variants:
        print(sweep_moe_mmq.header(), flush=True)
    for tokens in [int(t) for t in tokens_list.split(",")]:
        layers = _layers(torch, args.layers, tokens, True)
        if args.gemv_tiles:
            rows = gemv_tiles(torch, layers, tokens)
            res["gemv_tiles"] += rows
            for gated in (True, False):
                ranked = sorted((r for r in rows if r["gated"] == gated), key=lambda r: r["us"])
                rule = next(r for r in ranked if r["rule"])
                for r in ranked[:6] + ([rule] if rule not in ranked[:6] else []):
                    diff = r["diff"] if isinstance(r["diff"], str) else f"{r['diff']:.1e}"
                    print(f"T={tokens:5d} {'gated' if gated else 'down ':5s} ROWS {r['rows']} STEP {r['step']} "
                          f"w{r['warps']} {r['us']:8.1f} us  diff {diff}{'  <- rule' if r['rule'] else ''}", flush=True)
            del layers
            torch.cuda.empty_cache()
            continue
        if "mmq" in variants:
            res["mmq"].append(sweep_moe_mmq.mmq_ab(torch, layers, tokens, _bench, _active_bytes, H, K))
            print(sweep_moe_mmq.row(res["mmq"][-1]), flush=True)
            del layers
            torch.cuda.empty_cache()
            continue
        dense = _layers(torch, 2, tokens, False)
        if args.dequant:
            r = dequant_ab(torch, layers, dense, tokens)
            res["dequant"].append(r)
            print(f"T={tokens:5d} ({r['slots']} slots) grouped GGUF {r['grouped_gguf_us']:.1f} us, dequantize + "
                  f"grouped dense {r['dequant_us']:.1f} us ({r['dequant_w4_us']:.1f} at 4 warps; the dequantization "
                  f"alone {r['dequantize_only_us']:.1f}), dense bf16 grouped {r['dense_us']:.1f} us, max diff "
                  f"{r['max_rel_diff']:.1e}", flush=True)
            del layers, dense
            torch.cuda.empty_cache()
            continue
        if not args.no_sweep:
            rows = sweep_passes(torch, layers, tokens, variants)
            res["passes"] += rows
            for r in sorted(rows, key=lambda r: (not r["gated"], r["us"])):
                check = "" if r["diff"] is None else f"  vs blocked {r['diff']:.1e}"
                print(f"T={tokens:5d} {'gated' if r['gated'] else 'down ':5s} m{r['block_m']:<3d} n{r['block_n']:<3d} "
                      f"w{r['warps']} {r['variant']:7s} {r['us']:8.1f} us {r['gbs']:7.0f} GB/s"
                      f"{'  <- rule' if r['rule'] else ''}{check}",
                      flush=True)
        e2e = end_to_end(torch, layers, dense, tokens, args.gemv_tokens, variants)
        res["end_to_end"].append(e2e)
        print(f"T={tokens:5d} fused {e2e['fused_us']:.1f} us ({e2e['gbs']:.0f} GB/s; eager {e2e['fused_eager_us']:.1f})"
              f"  per-expert loop {e2e['loop_us']:.1f} us  dense bf16 {e2e['dense_us']:.1f} us "
              f"({e2e['dense_gbs']:.0f} GB/s)  max diff {e2e['max_rel_diff']:.1e}", flush=True)
        if "gemv_us" in e2e:
            print(f"T={tokens:5d} grouped {e2e['grouped_us']:.1f} us, gemv {e2e['gemv_us']:.1f} us; dense bf16 grouped "
                  f"{e2e['dense_grouped_us']:.1f} us, gemv {e2e['dense_gemv_us']:.1f} us", flush=True)
        if "i8_gemv_us" in e2e:
            print(f"T={tokens:5d} gemv on int8 x {e2e['i8_gemv_us']:.1f} us against fp x {e2e['gemv_us']:.1f} us, max "
                  f"diff {e2e['i8_max_rel_diff']:.1e} ({e2e['i8_vs_fp_rel_diff']:.1e} from fp x's)", flush=True)
        if "words_us" in e2e:
            print(f"T={tokens:5d} words: fused {e2e['words_us']:.1f} us, grouped {e2e['words_grouped_us']:.1f} us, "
                  f"max diff {e2e['words_max_rel_diff']:.1e}", flush=True)
        del layers, dense
        torch.cuda.empty_cache()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
