"""tools/bench_decode_attention without a GPU (the GPU run is the tool itself): the sweep's distinct runs, the grid
each setting gives against what the kernel runs, and the report's pasteable table."""

from __future__ import annotations

import itertools
import os
import re

import numpy as np
import pytest

from backends.cuda.decode_table import DecodeTable
from kernels_src import paged_attention as pa
from tools import bench_decode_attention as bench

SWEEP = list(itertools.product((1, 16), (4096, 16384, 32768)))  # the run issue 13 asks for


def test_plan_dedupes_the_sweep_and_keeps_ours_first():
    runs = 0
    for batch, context in SWEEP:
        mine = bench.ours(batch, 132)
        plan = bench.plan(context, mine)
        assert next(iter(plan.values())) == mine
        for s in bench.settings(mine):
            key = (*s.grid(context), s.block_n, s.num_warps)
            assert key in plan and plan[key].grid(context) == s.grid(context)
            n, plen = s.grid(context)
            assert n * plen >= context and plen % s.block_n == 0 and n <= s.max_parts and n & (n - 1) == 0
        runs += len(plan)
        alone = bench.plan(context, mine, sweep=False)  # --budget 0: an A/B of a switch at our setting
        assert list(alone.values()) == [mine] and list(alone) == list(plan)[:1]
    # ~70 ms a run on an H200 (10 replays of 5 ms, the capture) plus the compile pass: within ~120 s
    assert runs <= 220


@pytest.mark.parametrize("setting, context", [(bench.Setting(64, 4, 32, 4), 300), (bench.Setting(32, 8, 32, 4), 90),
                                              (bench.Setting(64, 2, 64, 8), 700)])
def test_grid_is_what_the_kernel_runs(setting, context):
    """The kernel (DSL interpreter) under the launch the tool makes fills exactly the partitions Setting.grid says,
    and matches the reference."""
    rng = np.random.default_rng(context)
    n, plen = setting.grid(context)
    blocks = -(-context // 16)
    kc, vc = (rng.standard_normal((blocks, 16, 1, 16)).astype(np.float32) for _ in range(2))
    tables = rng.permutation(blocks).astype(np.int32)[None]
    q, ctx = rng.standard_normal((1, 2, 16)).astype(np.float32), np.array([context], np.int32)
    ws = [np.full(sh, np.nan, np.float32) for sh in [(1, 2, n)] * 2 + [(1, 2, n, 16)]]
    out = pa.paged_decode(q, kc, vc, tables, ctx, 0.3, max_context=n * setting.partition, partition=setting.partition,
                          max_parts=n, block_n=setting.block_n, workspace=ws)
    np.testing.assert_allclose(out, pa.paged_decode_ref(q, kc, vc, tables, ctx, 0.3), rtol=1e-5, atol=1e-5)
    assert (ws[1][0, :, :-(-context // plen)] > 0).all()  # every partition up to the context's last holds keys
    assert -(-context // plen) == n or context <= n * setting.partition


def test_report_pastes_into_the_decode_table(capsys):
    """Synthetic times (finer partitions and 32-key tiles win at batch 1, 128-key ones at batch 16): the report's
    table literals evaluate, and its --decode-table parses to the same table, which runs the settings it names."""
    rows = []
    for batch, context in SWEEP:
        plan = bench.plan(context, bench.ours(batch, 132))
        times = {k: (1 + abs(k[1] - 64 * batch) / 1e3) * (0.9 if k[2] == (32 if batch == 1 else 128) else 1.0)
                 * (1 + k[3] / 100) for k in plan}
        best = min(times, key=times.get)
        mine = bench.ours(batch, 132)
        rows.append(dict(batch=batch, context=context, ours=mine, best=plan[best], times=times, floor_us=1.0,
                         best_us=times[best] * 1e6,
                         ours_us=times[(*mine.grid(context), mine.block_n, mine.num_warps)] * 1e6))
    bench.report(rows, [1, 16], 132)
    text = capsys.readouterr().out
    spec = re.search(r"--decode-table '([^']+)'", text).group(1)
    literals = {}
    for name in ("DECODE_PARTITIONS", "DECODE_TILES"):
        literals[name] = eval(re.search(rf"^{name} = (.+?)(  #.*)?$", text, re.M).group(1))
    table = DecodeTable.parse(spec)
    assert table == DecodeTable(literals["DECODE_PARTITIONS"], tiles=literals["DECODE_TILES"])
    assert table.tile(8) == (32, 4) and table.tile(128) == (128, 4)
    for batch in (1, 16):  # the table's rows keep the runner's cap at each batch: the A/B runs what was timed
        assert bench.ours(batch, 132, table).max_parts == bench.ours(batch, 132).max_parts
    assert "BEST_DECODE = {" in text and "(16, 32768): Setting(" in text


def test_shape_sets_the_layer_here_and_for_the_workers(monkeypatch):
    """--shape phi3-mini: 32 KV heads of 96 (MHA), so batch 1 is 32 programs, and spawned workers see it too."""
    monkeypatch.delenv(bench.SHAPE_ENV, raising=False)
    saved = bench.Q_HEADS, bench.KV_HEADS, bench.HEAD_DIM, bench.SCALE
    try:
        bench.use_shape("phi3-mini")
        assert (bench.Q_HEADS, bench.KV_HEADS, bench.HEAD_DIM) == (32, 32, 96)
        assert bench.kv_bytes(1, 1000) == 2 * 1000 * 32 * 96 * 2
        table = DecodeTable()
        assert bench.ours(1, 132) == bench.Setting(table.partition(32), table.grid_cap(32, 132), *table.tile(32))
        assert os.environ[bench.SHAPE_ENV] == "phi3-mini"
    finally:
        bench.Q_HEADS, bench.KV_HEADS, bench.HEAD_DIM, bench.SCALE = saved


def test_fp8_caches_and_their_bytes(monkeypatch):
    """--kv-cache-dtype fp8: the bytes read are a byte an element and a scale a token and head (132 / 256 of bf16's
    at head dim 128), and the caches it builds decode (kv_fp8's reference) within e4m3's half step of the bf16's."""
    import torch

    from kernels_src import kv_fp8

    bf16 = bench.kv_bytes(16, 16384)
    monkeypatch.setenv(bench.KV_ENV, "fp8")
    assert bench.kv_bytes(16, 16384) / bf16 == (bench.HEAD_DIM + 4) / (2 * bench.HEAD_DIM)
    x = torch.randn((3, 16, 2, 128), generator=torch.Generator().manual_seed(0)).bfloat16()
    codes, scales = bench.e4m3_cache(torch, x)
    back = kv_fp8.dequantize_ref(codes.numpy(), scales.numpy())
    assert codes.dtype == torch.uint8 and scales.shape == x.shape[:3]
    assert (np.abs(back - x.float().numpy()) <= np.abs(x.float().numpy()) / 16 + scales.numpy()[..., None] / 1024).all()
