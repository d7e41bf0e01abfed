"""Decode at every context the engine admits: the split-K grid is capped (Runner.max_partitions) and longer contexts
get longer partitions, so one CUDA graph per (batch bucket, partitions) key serves any context and every key is
captured at start-up.

On the CPU (CI): the key logic covers every (batch, context) up to max_model_len with a handful of keys per bucket,
and the CUDA backend on CPU tensors decodes past the capped grid against the reference interpreter. On a GPU
(tools/gpu_check.sh): the engine with CUDA graphs and overlapped steps decodes prompts past every partition cap (the
first decode past 2,048 tokens once aborted the process), token for token as eager steps do, capturing nothing on
first use.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from backend_greedy import backend_greedy, host
from test_tiny_models import prompt, saved  # noqa: F401  (saved is a fixture)

from core.batch import make_batch
from ir.loader import load_model
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cpu_backend(model, **kw):
    from backends.cuda.backend import CUDABackend

    return CUDABackend(model, device="cpu", dtype="f32", progress=False, **kw)


@pytest.mark.parametrize("max_batch, max_context, table", [(256, 32768, None), (6, 2048, None), (64, 131072, None),
                                                            (64, 131072, "4:32/32x8,16:128/128x4,1024/64x8,max=128")])
def test_every_decode_step_finds_a_start_up_key(max_batch, max_context, table, saved):  # noqa: F811
    from backends.cuda.decode_table import DecodeTable
    from backends.cuda.graphs import GraphKeys

    runner = cpu_backend(load_model(saved("llama3_rope")[1], progress=False)).runner
    if table:
        runner.decode = DecodeTable.parse(table)
    keys = GraphKeys(runner, max_batch, max_context)
    captured = set(keys.all())
    assert len(captured) == len(keys.all())
    per_bucket = runner.decode.max_partitions.bit_length()  # partitions 1, 2, 4, .., the cap
    assert len(captured) <= len(keys.buckets) * per_bucket
    rng = np.random.default_rng(max_context)
    steps = [(n, c) for n in range(1, max_batch + 1) for c in (1, max_context)]
    steps += [(int(n), int(c)) for n, c in zip(rng.integers(1, max_batch + 1, 500), rng.integers(1, max_context + 1,
                                                                                                   500), strict=True)]
    for n, c in steps:
        bucket, parts = keys.key(n, c)
        assert (bucket, parts) in captured and bucket >= n
        assert parts <= runner.max_partitions(bucket)
        if parts < runner.max_partitions(bucket):  # below the cap the grid's partitions hold the context
            assert parts * runner.decode_partition(bucket) >= min(c, max_context)


def test_max_partitions_fill_the_gpu_at_small_batches():
    from backends.cuda.decode_table import MAX_PARTITIONS, WAVES, DecodeTable

    cap = DecodeTable().grid_cap
    assert cap(8, 132) == MAX_PARTITIONS  # one sequence: many partitions, or 8 programs in all
    for rows in (1, 3, 16, 64, 256):
        p = cap(rows * 8, 132)
        assert p & (p - 1) == 0 and 1 <= p <= MAX_PARTITIONS
        assert rows * 8 * p >= WAVES * 132 or p == MAX_PARTITIONS
        assert p == 1 or rows * 8 * (p // 2) < WAVES * 132  # the smallest such power of two


def test_decode_table_spec():
    from backends.cuda.decode_table import DECODE_PARTITIONS, LONG_PARTITION, MAX_PARTITIONS, DecodeTable

    default = DecodeTable()
    assert DecodeTable.parse(default.spec()) == default and default.spec() == "8:64,32:128,128:256,512/64x4,max=64"
    for rows in range(1, 300):  # the rules before the table: keys by programs, tile 64 keys x 4 warps
        programs = rows * 8
        want = next((p for limit, p in DECODE_PARTITIONS if programs <= limit), LONG_PARTITION)
        assert default.partition(programs) == want and default.tile(programs) == (64, 4)
    t = DecodeTable.parse("8:64/32x8, 128:200/128x4, 1024, max=128")
    assert (t.partition(8), t.tile(8), t.partition(9), t.tile(9)) == (64, (32, 8), 256, (128, 4))  # 200 -> 2 tiles
    assert (t.partition(129), t.tile(129), t.max_partitions) == (1024, (64, 4), 128)
    assert DecodeTable.parse(t.spec()) == t
    assert DecodeTable.parse("512").partitions == () and DecodeTable.parse("max=8").long_partition == LONG_PARTITION
    assert DecodeTable.parse("").max_partitions == MAX_PARTITIONS
    # min=: a floor under WAVES' cap (the fp8 cache's 64-sequence grids at 4 partitions, not 2), under max=
    floor = DecodeTable.parse("128/128x4,max=64,min=4")
    assert [floor.grid_cap(p, 132) for p in (8, 128, 512, 4096)] == [64, 8, 4, 4]
    assert [default.grid_cap(p, 132) for p in (8, 128, 512, 4096)] == [64, 8, 2, 1]
    assert DecodeTable.parse(floor.spec()) == floor and "min=4" in floor.spec() and "min" not in default.spec()
    for bad in ("8:64/48x4", "8:64/64x3", "16:64,8:32", "8:64:2", "max=", "max=0", "max=48", "min=3", "max=4,min=8"):
        with pytest.raises(ValueError, match="decode t"):
            DecodeTable.parse(bad)


def test_decode_past_the_capped_grid_matches_reference(saved):  # noqa: F811
    """CPU tensors, eager steps: a two-SM "GPU" caps the grid at 2 partitions, so 150-token contexts are cut into
    longer partitions than the batch's partition size (64); logits match the reference interpreter, with the partials
    combined in the decode's last partition or by the reduce kernel, and under a swapped decode table."""
    from backends.cuda.decode_table import DecodeTable

    model = load_model(saved("llama3_rope")[1], progress=False)
    model.config = model.config.with_(max_position_embeddings=512)  # its 128 would end the rope tables
    backend = cpu_backend(model)
    backend.runner.sms = 2
    assert backend.runner.max_partitions(2) == 2 and 2 * backend.runner.decode_partition(2) < 150
    prompts = [prompt(1, 150), prompt(2, 97)]
    ref = ReferenceRunner(model, max_tokens=256, block_size=8)
    ref_tokens, ref_first = ref.greedy(prompts, 3)
    tokens, first = backend_greedy(backend, ref, prompts, 3, 8)
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
    assert tokens == ref_tokens
    # A decode step's logits, capped (2 partitions of 75 and 49 keys) and not (3 and 2 partitions of 64 keys).
    tables = [ref._table(i) for i in range(2)]
    step = make_batch([[t[0]] for t in tokens], [len(p) for p in prompts], tables, 8)
    capped = host(backend.forward(step))
    # the partials combined by the decode's last partition (LLM_ENGINE_FUSED_REDUCE=1), its counters left at 0, as
    # by the reduce kernel (the default)
    backend.runner.fused_reduce = True
    np.testing.assert_allclose(capped, host(backend.forward(step)), rtol=1e-5, atol=1e-5)
    assert backend.runner._counters and not any(c.any() for c in backend.runner._counters)
    backend.runner.fused_reduce = None
    backend.runner.sms = 132
    np.testing.assert_allclose(capped, host(backend.forward(step)), rtol=1e-5, atol=1e-5)
    # A swapped table (bench_gpu --decode-table): 32-key tiles of 8 warps, 2 partitions of 96 and 64 keys.
    backend.runner.decode = DecodeTable.parse("64:32/32x8,max=2")
    assert backend.runner.max_partitions(2) == 2 and backend.runner.decode.tile(4) == (32, 8)
    np.testing.assert_allclose(capped, host(backend.forward(step)), rtol=1e-5, atol=1e-5)


# --- GPU only --------------------------------------------------------------------------------------------------

def _engine(model, graphs: bool, overlap: bool, max_len: int):
    from backends.cuda.backend import CUDABackend
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    backend = CUDABackend(model, device="cuda", dtype="f32", cuda_graph=graphs, progress=False)
    config = EngineConfig(num_kv_blocks=3 * max_len // 16 + 16, block_size=16, async_scheduling=overlap,
                          max_model_len=max_len,
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048,
                                                    prefill_chunk_size=2048))
    return LLMEngine(backend, config)


@needs_cuda
@pytest.mark.parametrize("overlap", [True, False])
def test_long_prompts_decode_with_graphs_as_eager_steps(overlap, saved):  # noqa: F811
    """A 2,100-, a 5,000-, a 9,000- and a 30,000-token prompt (past every partition cap: the tiny model's 2 KV heads
    cap batch 1 at 64 partitions of 64 keys) decode with CUDA graphs, token for token as eager steps, and no graph
    is captured on first use."""
    from core.sampling_params import SamplingParams

    model = load_model(saved("llama3_rope")[1], progress=False)
    max_len = 30200
    model.config = cfg = model.config.with_(max_position_embeddings=max_len)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (2100, 5000, 9000, 30000)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        engine = _engine(model, graphs, overlap, max_len)
        if graphs:
            captured = set(engine.backend.graphs.graphs)
            assert not engine.backend.graphs.failed
        outs = {}
        for i, p in enumerate(prompts):
            engine.add_request(p, params, f"r{i}")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
        if graphs:
            assert set(engine.backend.graphs.graphs) == captured  # nothing captured on first use
        assert engine.all_blocks_free()
        runs.append(outs)
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0].values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_cache_allocated_again_lets_go_of_the_old_one(device, saved):  # noqa: F811
    """allocate_kv after a decoded request holds no tensor of the old cache (the layers' lookup of them,
    attention.layer's, used to keep it until the next step's attention): an ablation's engine at 16 x 32k tokens
    otherwise needed room for two 64 GiB caches and ran out of the H200's memory (session 19). On a GPU the memory
    torch holds after the second allocation is what it held after the first."""
    import gc
    import weakref

    from backends.cuda.backend import CUDABackend
    from core.sampling_params import SamplingParams
    from frontend.engine.engine import EngineConfig, LLMEngine
    from frontend.engine.scheduler import SchedulerConfig

    model = load_model(saved("llama3_rope")[1], progress=False)
    backend = CUDABackend(model, device=device, dtype="f32", progress=False, cuda_graph=False)
    config = EngineConfig(num_kv_blocks=64, block_size=16, scheduler=SchedulerConfig(max_num_seqs=2))
    engine = LLMEngine(backend, config)
    engine.add_request(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    old = [weakref.ref(t) for layer in backend.kv for t in layer]
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    del engine
    gc.collect()
    backend.allocate_kv(64, 16)
    gc.collect()
    assert old and all(r() is None for r in old)
    if device == "cuda":
        assert torch.cuda.memory_allocated() <= held
