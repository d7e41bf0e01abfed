"""tools/bench_gpu's tensor-parallel path (`--d 0,1`) on CPU tensors (gloo, Triton's interpreter): a tiny
Llama-3-shaped model whose random weights each rank makes itself (backends/cuda/synthetic) gives over two processes
the greedy tokens one process gives: the ranks' slices are consistent slices of one model. TEST_TP_DEVICE=cuda
(tools/gpu_check.sh's tests_tp step) runs the same on GPUs 0 and 1 (NCCL, CUDA graphs); the benchmark itself is its
bench_tp step."""

from __future__ import annotations

import importlib.util
import os

import pytest

from ir.rope import RopeSpec
from ir.sharding import shard
from tools.bench_gpu_model import loaded_model, model_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")
ON_CUDA = os.environ.get("TEST_TP_DEVICE") == "cuda"


def tiny():
    """Llama-3-8B's architecture at toy width: 2 layers, 4 query and 2 KV heads of 16, a 256-token vocabulary."""
    return loaded_model(model_config(2, "llama3-8b").with_(hidden_size=64, intermediate_size=128, num_heads=4,
                                                           num_kv_heads=2, head_dim=16, vocab_size=256,
                                                           max_position_embeddings=64,
                                                           rope=RopeSpec(theta=500000.0, rotary_dim=16)))


def test_each_rank_makes_its_slice_of_one_model():
    """Every rank's parameters equal the matching slice of the one-process parameters, bit for bit (columns of q/k/v
    and gate/up, rows of o and down, vocabulary rows of the embedding and head); different names differ."""
    from backends.cuda.synthetic import random_params

    model = tiny()
    whole = random_params(model.graph, "f32", "cpu", seed=3)
    assert abs(whole["layers.0.wq"].std().item() - 0.02) < 0.002 and not torch.equal(whole["layers.0.wq"],
                                                                                     whole["layers.1.wq"])
    assert torch.equal(whole["layers.0.attn_norm"], torch.ones(64))
    cut_axes = set()
    for rank in range(2):
        g = shard(model.graph, rank, 2)
        for name, t in random_params(g, "f32", "cpu", seed=3).items():
            cut = g.params[name].cut
            want = whole[name] if cut is None else whole[name].narrow(cut[0], cut[1], cut[2] - cut[1])
            assert torch.equal(t, want), name
            cut_axes.add(None if cut is None else cut[0])
    assert cut_axes == {None, 0, 1}
    assert not torch.equal(random_params(model.graph, "f32", "cpu", seed=4)["embed"], whole["embed"])


def greedy(options: dict, prompts: list[list[int]], new: int) -> list[list[int]]:
    """bench_gpu's engine (engine_for, its random weights) with `options` (cli_options' form), greedy tokens."""
    from core.sampling_params import SamplingParams
    from tools.bench_gpu import engine_for

    engine = engine_for(tiny(), None, len(prompts), 32, graphs=ON_CUDA, overlap=False, options=options, dtype="f32")
    try:
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for r in engine.step():
                out[r.request_id] += r.outputs[0].delta_token_ids
        return [out[i] for i in ids]
    finally:
        if engine.backend.workers is not None:
            engine.backend.workers.close()


def test_two_ranks_give_one_rank_tokens():
    prompts, new = [[1, 5, 9, 200, 17], [42, 7]], 4
    if ON_CUDA and torch.cuda.device_count() < 2:
        pytest.skip("two GPUs needed")
    one = greedy({"device": "cuda:0" if ON_CUDA else "cpu"}, prompts, new)
    two = greedy({"device": ["cuda:0", "cuda:1"] if ON_CUDA else ["cpu", "cpu"]}, prompts, new)
    assert two == one and all(len(t) == new for t in one)
    assert len({t for ts in one for t in ts}) > 1  # not a degenerate model repeating one token


def test_report_holds_the_runs_to_the_issue_targets(tmp_path):
    """tools/bench_tp_report on bench_gpu-shaped JSON: TP 2 / TP 1 ratios, 70B's fraction of the summed copy
    roofline, each with its target; a missing run leaves its figures out rather than failing."""
    import json

    from tools.bench_tp_report import figures, load

    def run(decode: dict, copy: float, nbytes: float) -> dict:
        return {"decode": {str(b): v for b, v in decode.items()}, "copy_gbs": copy, "bf16_bytes": nbytes,
                "prefill_tps": 40000.0}

    for name, res in {"tp1.json": run({1: 250.0, 64: 11000.0}, 4000.0, 16e9),
                      "tp2.json": run({1: 400.0, 64: 16500.0}, 8000.0, 16.1e9),
                      "tp2_70b.json": run({1: 40.0}, 8000.0, 141e9)}.items():
        (tmp_path / name).write_text(json.dumps(res))
    rows = {name: (v, target) for name, v, target in figures(load(tmp_path))}
    assert rows["8B TP 2 / TP 1 decode b1"] == (pytest.approx(1.6), 1.5)
    assert rows["8B TP 2 / TP 1 decode b64"] == (pytest.approx(1.5), 1.6)
    assert rows["8B TP 1 decode b1 of roofline"][0] == pytest.approx(250 / (4000 / 16))
    assert rows["70B TP 2 decode b1 of roofline"] == (pytest.approx(40 / (8000 / 141)), 0.7)
    assert "8B TP 2 / TP 1 decode b16" not in rows and not any(n.startswith("all-reduce") for n in rows)
