"""tools/sweep_moe's mmq variant (`python -m tools.sweep_moe --variants blocked,mmq --tokens 16,32,64,128,256`): one
Qwen3-30B-A3B MoE layer over Q4_K_M stacks through the grouped passes on int8 tensor cores (kernels_src/moe_mmq.py)
against the paths a step takes today: the GEMV a slot (moe_gemv, the default up to moe_gemv.GGUF_GEMV_SLOTS), the
dequantize + dense grouped path (moe_dequant, the grouped default) and the grouped GGUF kernel (moe_gguf); at
TILE_TOKENS also moe_mmq's other tiles. A table a batch: what places moe_mmq.MMQ, its slot bounds (MMQ_MIN_SLOTS
against the GEMV, MMQ_SLOTS_PER_EXPERT against dequant) and its TILES."""

from __future__ import annotations

TILE_TOKENS = 64  # the batch at which moe_mmq's tiles are swept (issue 16's)
# (BLOCK_N, num_warps) tried for both passes beside moe_mmq.TILES' (64 x 4, or 64 x 8 where a pass reads Q6_K;
# sm_90 builds: 128 x 8 spills 8 bytes on Q6_K's down pass, timed anyway)
TILES = ((32, 4), (64, 8), (128, 8))


def mmq_ab(torch, layers, tokens: int, bench, active_bytes, h: int, k: int) -> dict:
    """us a layer of each path over `layers` (each (stacks, ids, weights)), moe_mmq's GB/s of the routed experts'
    blocks, and its output's largest difference from the dequant path's (relative to that path's largest |y|)."""
    from kernels_src import moe, moe_mmq

    x = torch.randn((tokens, h), device="cuda").bfloat16()

    def fused(**kw):
        for stacks, ids, w in layers:
            moe.moe_experts(x, w, ids, *stacks, target="triton", **kw)

    stacks, ids, w = layers[0]
    want = moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=False, mmq=False, dequant=True).float()
    got = moe.moe_experts(x, w, ids, *stacks, target="triton", gemv=False, mmq=True).float()
    n = len(layers)
    res = dict(tokens=tokens, slots=tokens * k, max_rel_diff=float((got - want).abs().max() / want.abs().max()),
               mmq_us=bench(lambda: fused(gemv=False, mmq=True)) / n * 1e6,
               gemv_us=bench(lambda: fused(gemv=True)) / n * 1e6,
               dequant_us=bench(lambda: fused(gemv=False, mmq=False, dequant=True)) / n * 1e6,
               grouped_gguf_us=bench(lambda: fused(gemv=False, mmq=False, dequant=False)) / n * 1e6)
    res["mmq_gbs"] = sum(active_bytes(*ls[:2]) for ls in layers) / n / (res["mmq_us"] / 1e6) / 1e9
    if tokens == TILE_TOKENS:
        rule, res["tiles"] = dict(moe_mmq.TILES), {}
        try:
            for tile in TILES:
                moe_mmq.TILES.update({False: tile, True: tile})
                res["tiles"][f"{tile[0]}x{tile[1]}w"] = bench(lambda: fused(gemv=False, mmq=True)) / n * 1e6
        finally:
            moe_mmq.TILES.update(rule)
    return res


def header() -> str:
    return (f"{'tokens':>6s} {'slots':>6s} {'mmq us':>8s} {'GB/s':>6s} {'gemv us':>8s} {'dequant us':>10s} "
            f"{'gguf us':>8s}  {'best':8s} diff")


def row(r: dict) -> str:
    paths = {p: r[f"{p}_us"] for p in ("mmq", "gemv", "dequant", "grouped_gguf")}
    best = min(paths, key=paths.get)
    line = (f"{r['tokens']:6d} {r['slots']:6d} {r['mmq_us']:8.1f} {r['mmq_gbs']:6.0f} {r['gemv_us']:8.1f} "
            f"{r['dequant_us']:10.1f} {r['grouped_gguf_us']:8.1f}  {best:8s} {r['max_rel_diff']:.1e}")
    if "tiles" in r:
        line += "\n       mmq tiles (BLOCK_N x warps, both passes): " + ", ".join(
            f"{t} {us:.1f} us" for t, us in r["tiles"].items())
    return line
