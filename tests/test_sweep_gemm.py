"""tools/sweep_gemm on the CPU: the whole tool (builds checked in-process, a fake clock for the CUDA-graph timer, a
fixed copy figure) on tiny problems through the DSL interpreter (Triton's interpreter has no bf16, the sweep's x),
its literals, and its argument errors."""

from __future__ import annotations

import json
import os

import pytest
from test_kernels_basic import HAS_TRITON

from kernels_src import dequant_gemm as dgm
from kernels_src import int_group_gemm as igm

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the sweep's problems are torch tensors")


@pytest.fixture
def sweep(monkeypatch):
    from tools import bench_kernels
    from tools import sweep_gemm as sweep

    monkeypatch.setattr(sweep, "TARGET", "numpy")
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "CHECK_N", 40)
    monkeypatch.setattr(sweep, "CHECK_K", 512)
    monkeypatch.setattr(sweep, "BLOCK_N", (32, 64))
    monkeypatch.setattr(sweep, "STAGES", (3,))
    monkeypatch.setattr(sweep, "COLD_BYTES", 20000)  # two weight copies a call
    monkeypatch.setattr(bench_kernels, "copy_gbps", lambda torch, nbytes: 1000.0)
    return sweep


def test_the_whole_tool_on_the_cpu(sweep, monkeypatch, tmp_path, capsys):
    """Every variant x build is checked against the reference (none fails), every problem timed within the budget,
    the best of each printed as TUNED literals that the launchers take, and the JSON written."""
    clock = iter(range(1, 10**6))
    monkeypatch.setattr(sweep, "BENCH", lambda torch, fn: (fn(), 100.0 - 0.01 * next(clock))[1])
    out = tmp_path / "x.json"
    assert sweep.main(["--variants", "blocked,words,sub64,gather,stream", "--ms", "16", "--shapes", "40x512",
                       "--qtypes", "Q4_K,int4g128", "--quick", "--workers", "0", "--budget", "1e9",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "failed: none" in text and "skipped" not in text
    data = json.loads(out.read_text())
    got = {(r["type"], r["variant"]) for r in data["results"]}
    assert got == {("Q4_K", "blocked"), ("Q4_K", "words"), ("Q4_K", "stream"), ("Q4_K", "sub64"),
                   ("int4g128", "blocked"), ("int4g128", "gather"), ("int4g128", "stream")}
    assert all(r["us"] < 100 for r in data["results"]) and sum(r["best"] for r in data["results"]) == 2
    streams = {r["type"]: r["tiles"] for r in data["results"] if r["variant"] == "stream"}
    assert streams["int4g128"]["accs"] in (1, 8)  # the int-group stream's own axis (its accumulators) kept
    assert streams["Q4_K"]["chunks"] in sweep.CHUNKS  # the GGUF stream's step searched and kept
    tables = text.split("TUNED = {")[1:]
    assert len(tables) == 2
    gguf = eval("{" + tables[0].split("}\n")[0] + "}")  # the printed literal, as pasted
    ints = eval("{" + tables[1].split("}\n")[0] + "}")
    assert set(gguf) == {("Q4_K", 16, 40, 512)} and set(ints) == {(4, 128, 16, 40, 512)}
    monkeypatch.setattr(dgm, "TUNED", gguf)
    monkeypatch.setattr(igm, "TUNED", ints)
    assert dgm.tuned_variant("Q4_K", 16, 40, 512) == gguf[("Q4_K", 16, 40, 512)]["variant"]
    assert igm.tuned_variant(16, 40, 512, 4, 128) == ints[(4, 128, 16, 40, 512)]["variant"]
    for key, v in ints[(4, 128, 16, 40, 512)].items():
        if key in igm._KEYS and key != "bk":
            assert igm.default_tiles(16, 40, 512, 4, 128)[igm._KEYS[key]] == v
    # The JSON named by LLM_ENGINE_GEMM_TUNED gives the launchers the same entries, over empty tables
    from kernels_src import gemm_tuned

    monkeypatch.setattr(dgm, "TUNED", {})
    monkeypatch.setattr(igm, "TUNED", {})
    monkeypatch.setenv(gemm_tuned.TUNED_ENV, str(out))
    for f in (gemm_tuned.sweep_rows, dgm._env_tuned, igm._env_tuned):
        f.cache_clear()
    try:
        assert dgm.tuned("Q4_K", 9, 40, 512) == gguf[("Q4_K", 16, 40, 512)]  # 9 rows: the same bucket
        assert igm.tuned_entry(4, 128, 16, 40, 512) == ints[(4, 128, 16, 40, 512)]
        assert dgm.tuned("Q6_K", 16, 40, 512) == {} and igm.tuned_entry(8, 128, 16, 40, 512) == {}
        # a second file (another sweep's, here this one's rows renamed Q6_K) joins the first; the first holds ties
        q6 = json.loads(out.read_text())
        for r in q6["results"]:
            r["type"], r["tiles"] = "Q6_K" if r["type"] == "Q4_K" else r["type"], dict(r["tiles"], split_k=8)
        (tmp_path / "q6.json").write_text(json.dumps(q6))
        monkeypatch.setenv(gemm_tuned.TUNED_ENV, f"{out}{os.pathsep}{tmp_path / 'q6.json'}")
        for f in (gemm_tuned.sweep_rows, dgm._env_tuned, igm._env_tuned):
            f.cache_clear()
        assert dgm.tuned("Q6_K", 16, 40, 512) == dict(gguf[("Q4_K", 16, 40, 512)], split_k=8)
        assert dgm.tuned("Q4_K", 16, 40, 512) == gguf[("Q4_K", 16, 40, 512)]
        assert igm.tuned_entry(4, 128, 16, 40, 512) == ints[(4, 128, 16, 40, 512)]
        out.write_text("[1, 2]")
        gemm_tuned.sweep_rows.cache_clear()
        with pytest.raises(ValueError, match="not a sweep_gemm --json table"):
            gemm_tuned.sweep_rows()
    finally:
        monkeypatch.delenv(gemm_tuned.TUNED_ENV)
        for f in (gemm_tuned.sweep_rows, dgm._env_tuned, igm._env_tuned):
            f.cache_clear()


def test_stream_against_mmq(sweep, monkeypatch, tmp_path, capsys):
    """--variants stream,mmq on int4g128: mmq's builds (block_m up to the bucket, block_n 64 / 128, 4 or 8 warps, swap
    only) all pass the check, its search keeps to them, and its TUNED literal (the fake clock makes it the best)
    takes int_group_matmul to mmq at those tiles."""
    monkeypatch.setattr(sweep, "MMQ_BLOCK_N", (32, 64))  # the CPU's interpreter: small tiles
    monkeypatch.setattr(sweep, "MMQ_BLOCK_M", (16, 32))
    monkeypatch.setattr(sweep, "BLOCK_N", (64,))
    monkeypatch.setattr(sweep, "CHECK_K", 256)
    clock = iter(range(1, 10**6))
    monkeypatch.setattr(sweep, "BENCH", lambda torch, fn: (fn(), 100.0 - 0.01 * next(clock))[1])
    out = tmp_path / "x.json"
    assert sweep.main(["--variants", "stream,mmq", "--ms", "32", "--shapes", "40x512", "--qtypes", "int4g128",
                       "--quick", "--workers", "0", "--budget", "1e9", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "failed: none" in text and "skipped" not in text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"stream", "mmq"} and rows["mmq"]["best"]
    tiles = rows["mmq"]["tiles"]
    assert tiles["swap"] and tiles["block_m"] in (16, 32) and tiles["block_n"] in (32, 64)
    assert sweep.Kind("int4g32", 4, 32).variants == ("blocked", "gather", "stream")  # nibble halves of 16: no mmq
    ints = eval("{" + text.split("TUNED = {")[1].split("}\n")[0] + "}")
    monkeypatch.setattr(igm, "TUNED", ints)
    assert igm.tuned_variant(32, 40, 512, 4, 128) == "mmq"
    cfg = igm.default_tiles(32, 40, 512, 4, 128, variant="mmq")
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT"]) == (tiles["block_m"], tiles["block_n"], tiles["split_k"])


def test_a_wrong_kernel_fails_the_check(sweep, monkeypatch, capsys):
    """The workers' check catches a decoding bug (the gather variant's nibble shift off by one field); the tool then
    times none of its settings and proposes no table entry."""
    job = ("int4g128", "gather", 16, dict(block_m=16, block_n=32, num_stages=3, num_warps=4, swap=True))
    assert sweep.check(job)[1] <= sweep.TOL
    from kernels_src import int_group_gemm_gather as gather
    from kernels_src.dsl import launch as dsl_launch

    monkeypatch.setattr(dsl_launch, "_kernels", {})
    monkeypatch.setattr(gather, "gather_q", lambda words, k, BITS, GROUP: (words >> ((k % GROUP) % 8 * 4 + 4)) & 15)
    assert sweep.check(job)[1] > sweep.TOL
    monkeypatch.setattr(sweep, "BENCH", lambda torch, fn: (fn(), 1.0)[1])
    assert sweep.main(["--variants", "gather", "--ms", "16", "--shapes", "40x512", "--qtypes", "int4g128", "--quick",
                       "--workers", "0"]) == 0
    text = capsys.readouterr().out
    assert "failed: [" in text and "no setting passed the check" in text and "TUNED" not in text


def test_arguments(sweep):
    assert sweep.parse_kind("int4g128") == sweep.Kind("int4g128", 4, 128) and sweep.parse_kind("q6_k").name == "Q6_K"
    assert sweep.Kind("Q6_K").variants == ("blocked", "stream")
    assert sweep.Kind("Q4_K").variants == ("blocked", "words", "sub64", "stream")
    for bad, msg in ((["--qtypes", "Q7_K"], "unknown type"), (["--variants", "fast"], "unknown variants"),
                     (["--shapes", "40x100"], "not whole"), (["--ms", "a"], "bad --ms")):
        with pytest.raises(SystemExit, match=msg):
            sweep.main(bad + ["--workers", "0"])
