"""tools/bench_allreduce on gloo with two CPU processes (the GPU run is tools/gpu_check.sh's bench_tp step): every
size's all-reduce sums the two ranks' inputs exactly, and the bandwidths follow nccl-tests' definitions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serving import ROOT, child_env

pytest.importorskip("torch")


def test_two_gloo_ranks_sum_and_time_every_size(tmp_path):
    out = tmp_path / "ar.json"
    sizes = [4096, 8192, 65536]  # bytes of bf16: 2,048 to 32,768 elements (the last two: 1 and 8 rows of 4096)
    r = subprocess.run([sys.executable, "-m", "tools.bench_allreduce", "--cpu", "--world", "2", "--sizes",
                        ",".join(map(str, sizes)), "--max-reps", "5", "--json", str(out)], cwd=ROOT,
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert (res["world"], res["backend"], res["dtype"]) == (2, "gloo", "bf16")
    assert [row["bytes"] for row in res["rows"]] == sizes and "ok" in r.stdout and "WRONG" not in r.stdout
    for row in res["rows"]:
        n = row["elements"]
        # rank 0 gave 1 * (i % 7 + 1), rank 1 gave 2 * (i % 7 + 1): the sum holds 3 * (i % 7 + 1)
        assert row["sum_ok"] and row["total"] == 3 * sum(i % 7 + 1 for i in range(n))
        assert row["alg_gbs"] == pytest.approx(row["bytes"] / row["us"] / 1e3, rel=1e-9)
        assert row["bus_gbs"] == pytest.approx(row["alg_gbs"], rel=1e-9)  # 2 (n - 1) / n = 1 for two ranks
        assert row["graph_us"] is None  # CUDA graphs: GPUs only
