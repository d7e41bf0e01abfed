"""dequant_gemv's per-problem tiles (TUNED, consulted by default_tiles with K; rule_tiles the fallback), the GEMVs
a GGUF Llama-3-8B step runs (tools/gemv_shapes), and tools/sweep_gemv's code on the DSL interpreter (a fake clock)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_gguf_quants import random_raw
from test_kernels_basic import HAS_TRITON, dev, host

from ir.formats.gguf_quants import QTYPES as GGUF
from ir.formats.gguf_quants import row_bytes
from kernels_src import dequant_gemv as dg
from kernels_src import dequant_gemv_i8 as dgi


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def test_tuned_entries_are_valid():
    for (qtype, m, n, k), tiles in dg.TUNED.items():
        assert qtype in dg.QTYPES and 1 <= m <= 8 and n > 0 and k % GGUF[qtype].block_size == 0
        dg.check_tiles(qtype, tiles)  # raises on a bad entry
        assert dg.default_tiles(qtype.lower(), m, n, k) == tiles
        if qtype in dgi.I8_DEFAULT and tiles.get("int8_x", True):  # the int8 path has one part a lane
            assert tiles["PARTS"] == 1


def test_default_tiles_fall_back_to_the_rule(monkeypatch):
    monkeypatch.setattr(dg, "TUNED", {("Q6_K", 1, 4096, 14336): dict(ROWS=2, STEP=16, PARTS=2, num_warps=2)})
    assert dg.default_tiles("Q6_K", 1, 4096, 14336) == dict(ROWS=2, STEP=16, PARTS=2, num_warps=2)
    for q, m, n, k in (("Q6_K", 1, 4096, 4096), ("Q6_K", 2, 4096, 14336), ("Q6_K", 1, 1024, 14336),
                       ("Q5_K", 1, 4096, 14336)):
        assert dg.default_tiles(q, m, n, k) == dg.rule_tiles(q, m, n)
    got = dg.default_tiles("Q6_K", 1, 4096, 14336)
    got["ROWS"] = 8  # a copy: the table keeps its entry
    assert dg.TUNED[("Q6_K", 1, 4096, 14336)]["ROWS"] == 2


@pytest.mark.parametrize("tiles,what", [
    (dict(ROWS=4, STEP=4, PARTS=4, num_warps=1), "PARTS 4"),  # Q4_K's lane holds 2 vectors of a block
    (dict(ROWS=4, STEP=3, PARTS=1, num_warps=1), "STEP 3"),
    (dict(ROWS=0, STEP=4, PARTS=1, num_warps=1), "ROWS 0"),
    (dict(ROWS=4, STEP=4, PARTS=1, num_warps=3), "num_warps 3"),
    (dict(ROWS=4, STEP=4, PARTS=1), "keys must be"),
])
def test_check_tiles_names_the_problem(tiles, what):
    with pytest.raises(ValueError, match=what):
        dg.check_tiles("Q4_K", tiles)


def test_int8_x_in_tiles():
    dg.check_tiles("Q6_K", dict(ROWS=4, STEP=4, PARTS=1, num_warps=1, int8_x=False))
    with pytest.raises(ValueError, match="int8_x is a bool for Q4_K, Q5_K, Q6_K only"):
        dg.check_tiles("Q8_0", dict(ROWS=4, STEP=4, PARTS=1, num_warps=1, int8_x=True))
    with pytest.raises(ValueError, match="int8_x is a bool"):
        dg.check_tiles("Q6_K", dict(ROWS=4, STEP=4, PARTS=1, num_warps=1, int8_x=1))


@pytest.mark.parametrize("tuned_i8", [True, False])
def test_tuned_int8_x_picks_the_path(tuned_i8, monkeypatch, rng):
    """A TUNED entry's int8_x picks the path on the int8 targets (here the DSL interpreter, made one), and an
    explicit int8_x still wins: int8 x moves y by quantizing x (within its bound), fp32 x does not."""
    n, k = 6, 512
    monkeypatch.setattr(dgi, "I8_TARGETS", ("numpy",))
    monkeypatch.setattr(dg, "TUNED", {("Q6_K", 1, n, k): dict(ROWS=2, STEP=2, PARTS=1, num_warps=1, int8_x=tuned_i8)})
    w = random_raw("Q6_K", (n, k), rng, 0.05).reshape(n, row_bytes("Q6_K", k))
    x = rng.standard_normal((1, k)).astype(np.float32)
    want = dg.dequant_gemv_ref(x, w, "Q6_K")
    for explicit in (None, not tuned_i8):
        i8 = tuned_i8 if explicit is None else explicit
        err = np.abs(dg.dequant_gemv(x, w, "Q6_K", int8_x=explicit) - want)
        if i8:
            assert (err <= dgi.int8_error_bound(x, w, "Q6_K") + 1e-4).all() and err.max() > 1e-3 * np.abs(want).max()
        else:
            assert err.max() <= 1e-5 * np.abs(want).max()


def test_bad_override_is_a_clear_error(rng):
    w = random_raw("Q8_0", (4, 64), rng, 0.05).reshape(4, -1)
    with pytest.raises(ValueError, match=r"PARTS 3 \(a divisor of 4\)"):
        dg.dequant_gemv(np.ones((1, 64), np.float32), w, "Q8_0", parts=3)


def _record(monkeypatch, module) -> list:
    """Wraps module.compile so that the constants each call compiles with are kept (the kernel still runs)."""
    seen, real = [], module.compile

    def spy(fn, target, **kw):
        seen.append(kw)
        return real(fn, target, **kw)

    monkeypatch.setattr(module, "compile", spy)
    return seen


TARGETS = ["numpy", pytest.param("triton-interpret", marks=pytest.mark.skipif(not HAS_TRITON,
                                                                              reason="triton/torch not installed"))]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("key", [("Q8_0", 1, 4096, 14336), ("Q5_K", 1, 4096, 14336), ("Q4_K", 1, 4096, 14336)])
def test_tuned_tiles_compute_the_gemv(target, key, monkeypatch, rng):
    """A TUNED entry moved to a small problem (9 rows off its ROWS, K a few blocks off its STEP) is what the launcher
    compiles with, and y matches x @ dequantize(W).T (Q4_K on its int8 path: within quantizing x's bound)."""
    qtype, m, _, _ = key
    tiles = dg.TUNED[key]
    n, k = 9, 3 * GGUF[qtype].block_size
    monkeypatch.setattr(dg, "TUNED", {(qtype, m, n, k): tiles})
    i8 = tiles.get("int8_x", qtype in dgi.I8_DEFAULT)  # the path the entry was timed on
    seen = _record(monkeypatch, dgi if i8 else dg)
    w = random_raw(qtype, (n, k), rng, 0.05).reshape(n, row_bytes(qtype, k))
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = dev(np.full((m, n), np.nan, np.float32), target)
    dg.dequant_gemv(dev(x, target), dev(w, target), qtype, out=out, target=target, int8_x=i8)
    want = dg.dequant_gemv_ref(x, w, qtype)
    bound = dgi.int8_error_bound(x, w, qtype) if i8 else 0
    np.testing.assert_array_less(np.abs(host(out) - want), bound + 1e-5 * (1 + np.abs(want).max()))
    used = seen[-1]
    assert (used["ROWS"], used["STEP"], used["num_warps"]) == (tiles["ROWS"], tiles["STEP"], tiles["num_warps"])
    assert i8 or used["PARTS"] == tiles["PARTS"]


def test_step_gemvs_follow_llama_cpp():
    """Q4_K_M: attn_v and ffn_down Q6_K in llama.cpp's use_more_bits layers (the first and last 4 of 32, and every
    third from 6), so q+k fuse without v there; lm_head Q6_K. Every matrix's bytes are read once a step."""
    from tools.bench_gpu_model import loaded_model, model_config
    from tools.gemv_shapes import step_gemvs, tensor_type

    more = [0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31]
    c = step_gemvs("q4km")
    assert c[("Q6_K", 1024, 4096)] == c[("Q6_K", 4096, 14336)] == c[("Q4_K", 5120, 4096)] == len(more) == 16
    assert c[("Q4_K", 6144, 4096)] == c[("Q4_K", 4096, 14336)] == 32 - len(more)
    assert c[("Q4_K", 28672, 4096)] == c[("Q4_K", 4096, 4096)] == 32 and c[("Q6_K", 128256, 4096)] == 1
    assert all(tensor_type("q4km", f"layers.{i}.wv", 32) == ("Q6_K" if i in more else "Q4_K") for i in range(32))
    assert set(step_gemvs("q8_0")) == {("Q8_0", n, k) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096),
                                                                   (4096, 14336), (128256, 4096))}
    graph = loaded_model(model_config(32)).graph
    for f in ("q4km", "q5km", "q8_0"):
        total = sum(p.shape[0] * row_bytes(tensor_type(f, name, 32), p.shape[1]) for name, p in graph.params.items()
                    if len(p.shape) == 2 and name != "embed")
        assert sum(cnt * n * row_bytes(q, k) for (q, n, k), cnt in step_gemvs(f).items()) == total


def test_sweep_arguments():
    from tools import sweep_gemv as sweep

    assert sweep.parse_shapes("q6_k:1024x4096, Q4_K:4096x14336") == [("Q6_K", 1024, 4096), ("Q4_K", 4096, 14336)]
    for bad in ("Q4_K:4096x100", "Q7_K:16x256", "Q4_K:4096"):
        with pytest.raises(SystemExit, match="want QTYPE:NxK"):
            sweep.parse_shapes(bad)
    with pytest.raises(SystemExit, match="known files are q4km"):
        sweep.problems_for(["q3km"], "", "")
    probs, steps = sweep.problems_for(["q4km"], "", "Q6_K")
    assert probs == [("Q6_K", 4096, 14336), ("Q6_K", 128256, 4096), ("Q6_K", 1024, 4096)]  # the largest share first
    for q in ("Q4_K", "Q6_K", "Q8_0", "Q5_K"):
        sets = sweep.settings(q, 1, 4096, 14336)
        assert sets[0] == dg.rule_tiles(q, 1, 4096) and len(sets) == len({sweep._t(s) for s in sets}) <= 48
        assert all(dg.check_tiles(q, s) is None for s in sets)


@pytest.mark.skipif(not HAS_TRITON, reason="the sweep's problems are torch tensors")
def test_sweep_on_the_interpreter(monkeypatch, capsys):
    """tools/sweep_gemv's check, timing and report on the DSL interpreter (CPU tensors, a fake clock): what a GPU
    run executes, on small problems."""
    import torch

    from tools import sweep_gemv as sweep
    from tools.kernel_case_base import Dev
    from tools.kernel_cases import gguf_weights

    monkeypatch.setattr(sweep, "TARGET", "numpy")
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "rows_for", lambda m: (1, 2))
    monkeypatch.setattr(dg, "TUNED", {("Q8_0", 1, 16, 256): dict(ROWS=2, STEP=8, PARTS=1, num_warps=1)})
    assert sweep._check_one("Q8_0", 1, sweep.settings("Q8_0", 1, 16, 256)[1], 16, 256) is None
    d = Dev(0, "cpu")
    probs = [sweep.Problem(torch, d, [gguf_weights(d, q, 16, 256) for _ in range(2)], q, 1, 256)
             for q in ("Q8_0", "Q4_K")]
    clock = iter(range(1, 10**6))
    skipped = sweep._time(probs, {}, lambda fn: (fn(), 1000.0 - 10 * next(clock))[1], budget=1e9, t0=0.0,
                          quick=False)
    assert skipped == 0 and all(len(p.us) == len(sweep.settings(*p.key)) for p in probs)
    steps = {"tiny": {("Q8_0", 16, 256): 2, ("Q4_K", 16, 256): 1}}
    table = sweep._report(probs, 1000.0, steps)
    out = capsys.readouterr().out
    assert "essentials timed" in out and "tiny: 3 GEMVs a step" in out
    for p in probs:  # the fake clock runs down: the last setting timed is the best, and beats the rule
        assert table[p.key] == sweep.settings(*p.key)[-1]
    rule = {p.key: p.us[sweep._t(dg.rule_tiles(p.qtype, 1, 16))] for p in probs}
    assert sweep.step_us(steps["tiny"], rule) == 2 * rule[("Q8_0", 1, 16, 256)] + rule[("Q4_K", 1, 16, 256)]


def test_a_sweeps_json_table_goes_over_tuned(tmp_path, monkeypatch):
    """tools/sweep_gemv --json's file, named by LLM_ENGINE_GEMV_TUNED, takes precedence over TUNED for its problems
    only; a bad entry is refused with its setting named."""
    import json

    good = tmp_path / "tuned.json"
    good.write_text(json.dumps([[["Q4_K", 1, 4096, 14336], dict(ROWS=2, STEP=4, PARTS=1, num_warps=2)]]))
    monkeypatch.setenv(dg.TUNED_ENV, str(good))
    dg._env_tuned.cache_clear()
    try:
        assert dg.default_tiles("Q4_K", 1, 4096, 14336) == dict(ROWS=2, STEP=4, PARTS=1, num_warps=2)
        assert dg.default_tiles("Q8_0", 1, 4096, 14336) == dg.TUNED[("Q8_0", 1, 4096, 14336)]
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps([[["Q4_K", 1, 4096, 14336], dict(ROWS=2, STEP=3, PARTS=1, num_warps=2)]]))
        with pytest.raises(ValueError, match="STEP 3"):
            dg.load_tuned(str(bad))
        with pytest.raises(ValueError, match="not a sweep_gemv --json table"):
            dg.load_tuned(str(tmp_path / "missing.json"))
    finally:
        monkeypatch.delenv(dg.TUNED_ENV)
        dg._env_tuned.cache_clear()
