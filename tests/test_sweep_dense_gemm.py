"""tools/sweep_dense_gemm on the CPU: the whole tool (builds checked in-process, a fake clock under which cuBLAS is
slow at 16 rows and fast at 32, a fixed copy figure) on a tiny problem through the DSL interpreter: only the
problem where the GEMM beat cuBLAS enters the printed TUNED literal and the JSON's `use` rows, which
LLM_ENGINE_DENSE_GEMM_TUNED then hands to the launcher; and its argument errors."""

from __future__ import annotations

import json

import pytest
from test_kernels_basic import HAS_TRITON

from kernels_src import dense_gemm as dgm

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the sweep's problems are torch tensors")


@pytest.fixture
def sweep(monkeypatch):
    from tools import bench_kernels
    from tools import sweep_dense_gemm as sweep

    monkeypatch.setattr(sweep, "TARGET", "numpy")
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "CHECK_N", 40)
    monkeypatch.setattr(sweep, "BLOCK_N", (16, 32))
    monkeypatch.setattr(sweep, "BLOCK_K", (32, 64))
    monkeypatch.setattr(sweep, "SPLITS", (1, 2))
    monkeypatch.setattr(sweep, "COLD_BYTES", 40000)  # two weight copies a call
    monkeypatch.setattr(bench_kernels, "copy_gbps", lambda torch, nbytes: 1000.0)
    return sweep


def test_the_whole_tool_on_the_cpu(sweep, monkeypatch, tmp_path, capsys):
    import torch.nn.functional as F

    last, clock = {}, iter(range(1, 10**6))
    real_linear, real_mm = F.linear, dgm.dense_matmul

    def linear(x, w, *a):
        last["who"] = ("cublas", x.shape[0])
        return real_linear(x, w, *a)

    def mm(x, w, **kw):
        last["who"] = ("ours", x.shape[0])
        return real_mm(x, w, **kw)

    def bench(torch, fn):
        fn()
        who, m = last["who"]
        return {16: 200.0, 32: 1.0}[m] if who == "cublas" else 100.0 - 0.01 * next(clock)

    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(dgm, "dense_matmul", mm)
    monkeypatch.setattr(sweep, "BENCH", bench)
    monkeypatch.setattr(dgm, "TUNED", {})
    out = tmp_path / "t.json"
    assert sweep.main(["--ms", "16,32", "--shapes", "40x256", "--quick", "--workers", "0", "--budget", "1e9",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "failed: none" in text and "skipped" not in text and "no setting passed" not in text
    table = eval("{" + text.split("TUNED = {")[1].split("}\n")[0] + "}")  # the printed literal, as pasted
    assert list(table) == [(16, 40, 256)]
    rows = json.loads(out.read_text())["results"]
    assert [(r["m"], r["use"]) for r in rows] == [(16, True), (32, False)]
    assert rows[0]["tiles"] == table[(16, 40, 256)] and rows[0]["us"] < 100 and rows[0]["cublas_us"] == 100.0
    monkeypatch.setenv(dgm.TUNED_ENV, str(out))
    dgm._env_tuned.cache_clear()
    try:
        assert dgm.tuned(9, 40, 256) == table[(16, 40, 256)] and dgm.tuned(20, 40, 256) == {}
        t = dgm.default_tiles(12, 40, 256)
        assert all(t[dgm._KEYS[key]] == v for key, v in table[(16, 40, 256)].items())
    finally:
        monkeypatch.delenv(dgm.TUNED_ENV)
        dgm._env_tuned.cache_clear()


@pytest.mark.parametrize("argv,match", [(["--ms", "8"], "rows of 9 or more"), (["--shapes", "40by256"], "want NxK")])
def test_bad_arguments(sweep, argv, match):
    with pytest.raises(SystemExit, match=match):
        sweep.main(argv + ["--workers", "0"])
