"""tools/bench_gpu's synthetic shapes (tools/bench_gpu_model; the GPU run is gpu_check's): each builds its
architecture's graph at full width from its checkpoint's config.json, with the real model's sizes."""

from __future__ import annotations

import pytest

from tools.bench_gpu_model import SHAPES, loaded_model, model_config

FULL = {"llama3-8b": ("llama", 32, 4096, 128, None), "llama3-70b": ("llama", 80, 8192, 128, None),
        "gemma2-9b": ("gemma2", 42, 3584, 256, 4096), "phi3-mini": ("phi3", 32, 3072, 96, 2047),
        "qwen3-30b-a3b": ("qwen3_moe", 48, 2048, 128, None)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_build_at_full_width(shape):
    arch, layers, hidden, head_dim, window = FULL[shape]
    cfg = model_config(None, shape)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.sliding_window) == \
        (arch, layers, hidden, head_dim, window)
    one = loaded_model(model_config(1, shape))
    assert one.arch.name == arch and one.config.num_layers == 1
    assert one.graph.params["embed"].shape == (cfg.vocab_size, hidden)
    assert sum(n.op == "attention" for n in one.graph.nodes) == 1


def test_moe_roofline_counts_the_routed_experts_only():
    """Qwen3-30B-A3B reads 8 of its 128 experts a token: the batch-1 bytes are the dense part and 1/16 of the
    stacks (3.3 B active parameters of 30.5 B, in bf16), a batch of 16 most of them."""
    import torch

    from tools.bench_gpu_model import active_bytes

    graph = loaded_model(model_config(2, "qwen3-30b-a3b")).graph
    params = {n: torch.empty(p.shape, dtype=torch.bfloat16, device="meta") for n, p in graph.params.items()}
    stacks = sum(p.numel() * 2 for n, p in params.items() if p.dim() == 3)
    dense = sum(p.numel() * 2 for n, p in params.items() if p.dim() != 3)
    assert active_bytes(graph, params) == pytest.approx(dense + stacks / 16, rel=1e-6)
    assert active_bytes(graph, params, 16) == pytest.approx(dense + stacks * (1 - (15 / 16) ** 16), rel=1e-6)


def test_ablation_entries_and_the_decode_table_ab():
    """--ablations picks entries by name ('none': only the A/B), --decode-table adds a swapped runner table; a typo in
    either stops the run before the model is built."""
    from argparse import Namespace

    from backends.cuda.decode_table import DecodeTable
    from tools.bench_gpu import ABLATIONS, ablation_entries

    assert list(ablation_entries(Namespace(ablations="", decode_table=""))) == list(ABLATIONS)
    got = ablation_entries(Namespace(ablations="none", decode_table="8:64/32x8,1024"))
    (name, (attrs, fusions, overlap)), = got.items()
    assert name == "decode table 8:64/32x8,1024/64x4,max=64" and fusions is None and overlap
    assert attrs == {"decode": DecodeTable(((8, 64),), 1024, ((8, 32, 8),))}
    assert list(ablation_entries(Namespace(ablations="no PDL on attention", decode_table=""))) == \
        ["no PDL on attention"]
    for bad in (Namespace(ablations="no PDL at all", decode_table=""), Namespace(ablations="", decode_table="8:6:4")):
        with pytest.raises(SystemExit):
            ablation_entries(bad)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_quantized_variants_decode_to_small_finite_weights(kind):
    """bench_gpu --quant's random int4 / fp8 matrices (made on CPU here) decode, by the formats' own numpy
    dequantizers, to finite weights below 0.5: random bytes could hold NaN scales or codes and poison the logits."""
    import numpy as np

    from ir.formats import fp8_blocks, int_groups
    from tools.bench_gpu_model import fp8_params, int4_params

    graph = loaded_model(model_config(1, "llama3-8b").with_(hidden_size=256, intermediate_size=512,
                                                              vocab_size=1024)).graph
    params = (int4_params if kind == "int4" else fp8_params)(graph, device="cpu")
    w = params["layers.0.wq"]
    n, k = w.shape
    if kind == "int4":
        vals = int_groups.dequantize(w.data.numpy(), (n, k), *int_groups.parse_kind(w.qtype))
    else:
        vals = fp8_blocks.decode(w.data.numpy()) * np.repeat(w.scales.numpy(), 128, axis=1)
    assert np.isfinite(vals).all() and 0 < np.abs(vals).max() < 0.5


def test_outlier_steps_single_out_a_compile_inside_the_timed_steps():
    """decode_rate's note of a one-time cost: one 0.6 s step among 5 ms ones (a kernel compiled on first use) is
    found with its seconds; steady steps, or a step only 3x the median, are not."""
    from tools.bench_gpu_rates import outlier_steps

    steps = [0.005] * 63 + [0.6]
    assert outlier_steps(steps) == (1, 0.6, 0.005)
    assert outlier_steps([0.005] * 64) is None
    assert outlier_steps([0.005] * 63 + [0.015]) is None
    assert outlier_steps([0.0001] * 63 + [0.01]) is None  # 100x a tiny median, yet under the 50 ms floor


def test_step_spread_reports_slow_steps_under_the_outlier_bar():
    """Steps a rate averages in that outlier_steps lets through (31 steps of 10 ms and one of 150 ms: under 20x the
    median, yet the mean 44% over it) are named with the median, mean and slowest; steady steps give None."""
    from tools.bench_gpu_rates import outlier_steps, step_spread

    steps = [0.010] * 31 + [0.150]
    assert outlier_steps(steps) is None
    assert step_spread(steps) == "median 10.00 ms, mean 14.37 ms, slowest 150.0, 10.0, 10.0 ms (step 31)"
    assert step_spread([0.010] * 32) is None
    assert step_spread([0.010, 0.011] * 16) is None


def test_gc_pauses_counts_collections_by_generation():
    """decode_rate's note of the garbage collector's pauses: two forced collections (generations 0 and 2) are
    counted with their time, and the callback is gone afterwards."""
    import gc

    from tools.bench_gpu_rates import GcPauses

    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    assert pauses.counts == [1, 0, 1] and pauses.seconds > 0
    assert pauses._note not in gc.callbacks
    gc.collect()
    assert pauses.counts == [1, 0, 1]


def test_step_listing_names_each_change_of_sequences():
    """decode_rate --step-times: a step's sequence count is written where it changes, each step's ms after it."""
    from tools.bench_gpu_rates import step_listing

    assert step_listing([16, 16, 16, 15, 14, 14], [0.0095, 0.0095, 0.0096, 0.0142, 0.021, 0.013]) == \
        "16:9.5 9.5 9.6 15:14.2 14:21.0 13.0"


def test_start_batch_says_when_sequences_finish_before_the_last_first_token(make_engine, capsys):
    """bench_gpu_rates.start_batch on a real engine (SmolLM2 on MLX's CPU build): four 100-token prompts prefilled 64
    tokens a step. With 2 new tokens the first sequences finish before the last has its first token, and it says the
    timed steps would run fewer rows; with 60 every sequence is still decoding, nothing is said, and the aborted
    requests free their blocks (the fixture checks)."""
    from tools.bench_gpu_rates import start_batch

    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64)
    vocab = engine.backend.model.config.vocab_size
    start_batch(engine, 4, 100, 2, vocab, seed=0)
    running = len(engine.scheduler.running)
    said = capsys.readouterr().out
    assert running < 4 and f"the timed steps run {running} rows, not 4" in said
    while engine.has_unfinished():
        engine.step()
    ids = start_batch(engine, 4, 100, 60, vocab, seed=1)
    assert len(engine.scheduler.running) == 4 and capsys.readouterr().out == ""
    assert all(s.output_token_ids for s in engine.scheduler.running)
    for request_id in ids:
        engine.abort_request(request_id)
    assert not engine.has_unfinished()
