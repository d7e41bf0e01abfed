"""The CUDA backend against the IR reference interpreter.

Without a GPU it runs on CPU tensors with the DSL's kernels under Triton's interpreter (fp32): the tiny random
models of every architecture, a tiny GGUF with Q8_0 matrices kept quantized, and the engine end to end with
seeded sampling. On a GPU (tools/gpu_check.sh) the same cases run on CUDA in fp32 (tokens identical) and bf16
(logits within bf16 tolerance), plus SmolLM2's Q4_1 GGUF, CUDA graphs against eager steps, and split-K decode.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from backend_greedy import backend_greedy
from test_tiny_gguf import files  # noqa: F401  (a fixture)
from test_tiny_gguf import prompt as gguf_prompt
from test_tiny_models import MAIN, prompt, saved  # noqa: F401  (saved is a fixture)

from core.batch import make_batch
from ir.loader import load_model
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
# bf16 keeps 8 bits of mantissa: the tiny models' logits (|x| up to ~4) moved by up to 0.15 on an H200 after two
# layers of rounding; a wrong kernel moves them by whole units.
BF16_TOL = 0.1  # of max |logit|


def counting_steps(monkeypatch, backend, module, name: str, rows_of) -> list:
    """module.name's calls, as rows_of(args) each, made inside backend.forward only: on a GPU with graphs off,
    allocate_kv's eager warm-ups also launch every linear at every row count a step may have."""
    calls, inside, real, forward = [], [False], getattr(module, name), backend.forward

    def counted(*a, **kw):
        if inside[0]:
            calls.append(rows_of(a))
        return real(*a, **kw)

    def stepping(batch):
        inside[0] = True
        try:
            return forward(batch)
        finally:
            inside[0] = False

    monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(backend, "forward", stepping)
    return calls


def make_backend(model, device: str, **kw):
    from backends.cuda.backend import CUDABackend

    return CUDABackend(model, device=device, progress=False, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MAIN + ["qwen2_swa"])
def test_tiny_models_match_reference(case, device, saved):  # noqa: F811
    _, folder = saved(case)
    model = load_model(folder, progress=False)
    prompts = [prompt(1), prompt(2, 9), prompt(3, 17)]
    ref = ReferenceRunner(model, max_tokens=256, block_size=4)
    ref_tokens, ref_first = ref.greedy(prompts, 6)
    tokens, first = backend_greedy(make_backend(model, device, dtype="f32"), ref, prompts, 6, 4)
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
    assert tokens == ref_tokens


@pytest.mark.parametrize("case", ["llama3_rope", "qwen3"])
@needs_cuda
def test_tiny_models_bf16_on_gpu(case, saved):  # noqa: F811
    _, folder = saved(case)
    model = load_model(folder, progress=False)
    prompts = [prompt(1), prompt(2, 9)]
    ref = ReferenceRunner(model, max_tokens=256, block_size=4)
    _, ref_first = ref.greedy(prompts, 1)
    _, first = backend_greedy(make_backend(model, "cuda", dtype="bf16"), ref, prompts, 1, 4)
    assert float(np.abs(first - ref_first).max()) < BF16_TOL * float(np.abs(ref_first).max())


@pytest.mark.parametrize("device", DEVICES)
def test_gguf_q8_0_stays_quantized(device, files):  # noqa: F811
    """qwen3's tiny GGUF has Q8_0 matrices, its embedding among them: the GEMM (prefill), the quantized embedding
    lookup and, on a GPU, the GEMV (decode)."""
    from backends.cuda.weights import QuantWeight

    path, _, _ = files("qwen3")
    model = load_model(path, progress=False)
    backend = make_backend(model, device, dtype="f32")
    assert isinstance(backend.params["embed"], QuantWeight)
    assert sum(isinstance(p, QuantWeight) for p in backend.params.values()) >= 3
    # The prefill (33 rows) takes the GEMM, a decode step (2 rows) the GEMV. On CPU tensors the prefill alone: under
    # Triton's interpreter every GEMV program costs tens of ms and a step runs ~1,300 of them on this model (50 s on
    # two cores), and test_kernels_gemv checks the GEMV against numpy, tightly, for every format. Five decode steps
    # (the GEMV in the model) on a GPU.
    prompts = [gguf_prompt(1), gguf_prompt(2, 9)]
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    steps = 1 if device == "cpu" else 6
    ref_tokens, ref_first = ref.greedy(prompts, steps)
    tokens, first = backend_greedy(backend, ref, prompts, steps, 8)
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
    assert tokens == ref_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_gguf_batch_through_the_gemm(device, files, monkeypatch):  # noqa: F811
    """Ten sequences at once: prefill (29 rows) and every decode step (10 rows) take the dequantizing GEMM past
    GEMV_MAX_ROWS (counted through a pass-through wrapper), against the reference."""
    from backends.cuda import eager, gguf_linear
    from kernels_src import dequant_gemm

    path, _, _ = files("qwen3")
    model = load_model(path, progress=False)
    prompts = [gguf_prompt(10 + i, 2 + i % 3) for i in range(10)]
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    ref_tokens, ref_first = ref.greedy(prompts, 3)
    # Eager steps: graphs would also run the GEMM at every batch bucket while they are captured.
    backend = make_backend(model, device, dtype="f32", cuda_graph=False)
    calls = counting_steps(monkeypatch, backend, dequant_gemm, "dequant_matmul",
                           lambda a: (a[0].shape[0], a[1].shape[0]))  # (rows, N)
    tokens, first = backend_greedy(backend, ref, prompts, 3, 8)
    assert float(np.abs(first - ref_first).max()) <= 1e-4 * float(np.abs(ref_first).max())
    assert tokens == ref_tokens
    # A GPU's eager decode steps run their rows padded to a batch bucket, 16 here (backends/cuda/eager.padded_rows),
    # while the head's GEMM takes the 10 rows that want logits (padding rows ask for none).
    padded = backend.runner.arena is not None and eager.PAD_ROWS
    vocab = model.config.vocab_size
    assert {m for m, n in calls if n != vocab} == {16 if padded else 10, 29}
    assert {m for m, n in calls if n == vocab} == {10}  # the head: prefill's last rows and the decode rows
    assert gguf_linear.GEMV_MAX_ROWS < 10 <= gguf_linear.GEMM_MAX_ROWS


@pytest.mark.parametrize("case", ["llama3_rope", "qwen3"])
def test_fusions_off_match_fused(case, saved):  # noqa: F811
    """The fused kernels and the plain ones give the same logits: no fusion at all, and rope and the KV write as
    separate kernels (bench_gpu's ablation, switched after loading)."""
    from ir.fusion import Fusions

    model = load_model(saved(case)[1], progress=False)
    prompts = [prompt(1), prompt(2, 9)]
    ref = ReferenceRunner(model, max_tokens=256, block_size=4)
    fused = make_backend(model, "cpu")
    runs = [backend_greedy(fused, ref, prompts, 3, 4),
            backend_greedy(make_backend(model, "cpu", fusions=Fusions.none()), ref, prompts, 3, 4)]
    assert {n.op for n in fused.graph.nodes} >= {"rope_attention", "gated", "add_rms_norm", "slice"}
    fused.set_fusions(Fusions(rope_attention=False))
    assert {n.op for n in fused.graph.nodes} >= {"rope_pair", "attention"}
    runs.append(backend_greedy(fused, ref, prompts, 3, 4))
    for tokens, first in runs[1:]:
        assert tokens == runs[0][0]
        np.testing.assert_allclose(first, runs[0][1], rtol=1e-5, atol=1e-5)


def test_engine_end_to_end_with_seeded_sampling(saved):  # noqa: F811
    """The engine on the CUDA backend (CPU tensors) and on MLX give the same tokens: greedy, and seeded sampling
    with top-k/top-p through the backend's torch sampler."""
    pytest.importorskip("mlx", reason="the MLX backend is the other side of the comparison")
    from backends.mlx.backend import MLXBackend
    from core.sampling_params import SamplingParams
    from frontend.engine.engine import EngineConfig
    from frontend.engine.llm import LLM

    model = load_model(saved("llama3_rope")[1], progress=False)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.2, min_p=0.02, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)]
    prompts = [prompt(5), prompt(6, 11), prompt(7, 3)]
    runs = []
    for backend in (make_backend(model, "cpu"), MLXBackend(model, progress=False)):
        llm = LLM.from_backend(backend, EngineConfig(num_kv_blocks=64, block_size=8))
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.all_blocks_free()
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    ours, theirs = runs[0][2].logprobs, runs[1][2].logprobs
    assert [lp.token for lp in ours] == [lp.token for lp in theirs]
    assert np.allclose([lp.logprob for lp in ours], [lp.logprob for lp in theirs], atol=1e-4)


def test_rope_tables_cover_the_longest_context_only(saved):  # noqa: F811
    """A cache sized by free GPU memory may hold millions of tokens; rope tables stop at the engine's context."""
    backend = make_backend(load_model(saved("qwen2")[1], progress=False), "cpu")
    backend.set_limits(4, 100)
    backend.allocate_kv(1000, 16)
    assert [t.shape[0] for t in next(iter(backend.runner._rope.values()))] == [100, 100]
    backend.allocate_kv(4, 16)
    assert next(iter(backend.runner._rope.values()))[0].shape[0] == 64


def test_create_backend_picks_cuda_by_name(saved):  # noqa: F811
    from backends.base import create_backend

    backend = create_backend("cuda", load_model(saved("qwen2")[1], progress=False), device="cpu", progress=False)
    assert backend.name == "cuda" and backend.device.type == "cpu" and backend.dtype == "f32"


# --- GPU only --------------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_smollm_gguf_matches_reference(smollm, dtype):
    """fp32: the reference's tokens. fp16 (the default for GGUF) and bf16: step-0 logits within their rounding;
    fp16 also keeps the answer (bf16 may not: the two best first tokens lie 0.08 apart)."""
    ids = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ref = ReferenceRunner(smollm, max_tokens=256)
    ref_tokens, ref_first = ref.greedy([ids], 16)
    backend = make_backend(smollm, "cuda", **({} if dtype == "f16" else {"dtype": dtype}))
    assert backend.dtype == dtype
    tokens, first = backend_greedy(backend, ref, [ids], 16, 16)
    err = float(np.abs(first - ref_first).max())
    scale = float(np.abs(ref_first).max())
    assert err < {"f32": 1e-3, "f16": 0.01 * scale, "bf16": 0.05 * scale}[dtype], f"step-0 logits differ by {err}"
    if dtype != "bf16":
        assert tokens == ref_tokens
        assert "Paris" in smollm.tokenizer.decode(tokens[0])


@needs_cuda
def test_cuda_graphs_match_eager_steps_and_split_decode(saved):  # noqa: F811
    """Decode steps replayed from graphs give the eager steps' logits, at batch sizes between buckets and at
    contexts long enough for the split-K decode kernel (> 512 tokens: another graph key)."""
    model = load_model(saved("llama3_rope")[1], progress=False)
    model.config = cfg = model.config.with_(max_position_embeddings=2048)  # room for 1,100-token contexts
    graphs = make_backend(model, "cuda", dtype="f32")
    eager = make_backend(model, "cuda", dtype="f32", cuda_graph=False)
    rng = np.random.default_rng(0)
    lens = [3, 40, 600, 90, 1100]
    for b in (graphs, eager):
        b.set_limits(6, 2048)  # buckets 1, 2, 4 and 6: the 5 sequences below pad to 6
        b.allocate_kv(5 * 80, 16)
    tables = [list(range(i * 80, (i + 1) * 80))[::-1] for i in range(len(lens))]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    outs = []
    for b in (graphs, eager):
        b.forward(make_batch(prompts, [0] * 5, tables, 16))
        step = make_batch([[1], [2], [3], [4], [5]], lens, tables, 16)
        outs.append(b.forward(step).cpu().numpy())

    assert graphs.graphs is not None and graphs.graphs.buckets == [1, 2, 4, 6]
    part = graphs.runner.decode_partition(6)
    parts = 1 << (-(-1104 // part) - 1).bit_length()  # 1,104 tokens in partitions, rounded up to a power of two
    assert parts >= 4 and (6, parts) in graphs.graphs.graphs
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@needs_cuda
def test_kv_fraction_and_out_of_memory_message(saved):  # noqa: F811
    model = load_model(saved("qwen2")[1], progress=False)
    backend = make_backend(model, "cuda", dtype="f32", cuda_graph=False)
    free = torch.cuda.mem_get_info()[0]
    budget = backend.kv_budget(0.5, 256, 16)
    assert 0.3 * free < budget <= 0.5 * free
    with pytest.raises(MemoryError, match="does not fit"):
        backend.allocate_kv(4 * free // backend.kv_bytes_per_block(16), 16)


_PROBE = """
import sys, torch
from backends.cuda.backend import CUDABackend
from ir.loader import load_model
backend = CUDABackend(load_model(sys.argv[1], progress=False), device="cuda", dtype="f32", progress=False)
try:
    torch.ones(2, 2, device="cuda") @ torch.ones(3, 3, device="cuda")
except RuntimeError as e:
    print("shape", backend.is_fatal(e))
try:
    t = torch.zeros(3, device="cuda")
    t[torch.tensor([7], device="cuda")] = 1.0  # out of bounds: a device-side assert
    torch.cuda.synchronize()
except RuntimeError as e:
    print("assert", backend.is_fatal(e))
"""


@needs_cuda
def test_is_fatal_probes_the_device(saved):  # noqa: F811
    """A device-side assert poisons the CUDA context and is_fatal says so (the engine then stops, /health 503); an
    ordinary error (mismatched shapes) is not fatal. In a child process: a poisoned context fails everything after."""
    import subprocess
    import sys

    from tests.serving import ROOT, child_env

    out = subprocess.run([sys.executable, "-c", _PROBE, str(saved("qwen2")[1])], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["shape", "False", "assert", "True"], out.stdout + out.stderr[-2000:]


@needs_cuda
def test_one_row_steps_take_the_dense_gemv(saved, monkeypatch):  # noqa: F811
    """On a GPU the default sends a one-row step's dense linears through kernels_src/dense_gemv (with graphs off, as
    here, with their prologues: backends/cuda/eager.py) and a two-row step's through cuBLAS (fp16 weights: the GEMV's
    dtypes); the same tokens as with cuBLAS throughout, and first logits within fp16's reach of the fp32
    reference's."""
    from backends.cuda import linears

    model = load_model(saved("qwen2")[1], progress=False)
    b = make_backend(model, "cuda", dtype="f16", cuda_graph=False)
    calls = counting_steps(monkeypatch, b, linears, "dense_gemv", lambda a: a[0].shape[0])
    assert b.runner.dense_gemv and b.runner.gemv_prologues and b.runner.fused_reduce and b.runner.gemv_max_rows == 1
    ref = ReferenceRunner(model, max_tokens=64, block_size=4)
    for prompts in ([prompt(1, 5)], [prompt(1, 5), prompt(2, 7)]):
        _, ref_first = ref.greedy(prompts, 1)
        b.runner.dense_gemv = False
        plain, _ = backend_greedy(b, ref, prompts, 4, 4)
        b.runner.dense_gemv = True
        calls.clear()
        tokens, first = backend_greedy(b, ref, prompts, 4, 4)
        assert (set(calls) == {1}) if len(prompts) == 1 else not calls
        assert tokens == plain
        assert float(np.abs(first - ref_first).max()) <= 2e-2 * float(np.abs(ref_first).max())


def test_an_eager_step_lets_go_of_each_activation_after_its_last_reader(saved, monkeypatch):  # noqa: F811
    """A step holds a value only until the last node that reads it (Runner's drop plan): an 8B model's eager step of
    8,192 tokens otherwise held every layer's activations, ~1 GB a layer, to its end. Counted on CPU tensors through
    weak references to each node's result: with the plan, what is alive when a node runs stays a few values,
    whatever the depth; without it, every earlier value is. Logits unchanged."""
    import weakref

    from backends.cuda import node_steps

    model = load_model(saved("qwen3")[1], progress=False)
    b = make_backend(model, "cpu", dtype="f32", cuda_graph=False)
    ref = ReferenceRunner(model, max_tokens=64, block_size=4)
    real = b.runner.run_node
    made: list = []
    alive: list[int] = []

    def counting(node, args, meta, out=None):  # the real kernel; only its result's lifetime is watched
        alive.append(sum(r() is not None for r in made))
        y = real(node, args, meta, out)
        made.extend(weakref.ref(t) for t in (y if isinstance(y, tuple) else (y,)) if isinstance(t, torch.Tensor))
        return y

    monkeypatch.setattr(b.runner, "run_node", counting)
    prompts = [prompt(1, 9), prompt(2, 7)]
    tokens, first = backend_greedy(b, ref, prompts, 2, 4)
    peak, nodes = max(alive), len(b.runner.graph.nodes)
    plan = b.runner._steps.drops
    made.clear(), alive.clear()
    b.runner._steps = node_steps.Steps({})  # the plan off
    held, held_first = backend_greedy(b, ref, prompts, 2, 4)
    assert held == tokens and np.array_equal(held_first, first)
    assert max(alive) >= nodes // 2 > 3 * peak, (peak, max(alive), nodes)
    # each value is let go once, after a node that reads it, and no later node reads it
    order = {id(n): i for i, n in enumerate(b.runner.graph.nodes)}
    readers = b.runner.graph.uses()
    dropped = [vid for vids in plan.values() for vid in vids]
    assert len(dropped) == len(set(dropped))
    for nid, vids in plan.items():
        for vid in vids:
            assert max(order[id(n)] for n in readers[vid]) == order[nid]
