"""KV per layer group on gemma2 (sliding and global layers alternating) and gemma3 (two sliding layers to one
global): tiny random models through the engine on the MLX backend (eager and compiled decode) and the CUDA backend
on CPU tensors, with prompts seven windows long. A sequence's sliding-window blocks stay at its window's while its
global blocks grow with the context, and tokens and logprobs still equal transformers'.

Every free block of every pool is poisoned with NaN after each step (prefix caching off: nothing free is read
again), so a table entry still naming a block its sequence let go would turn the logits to NaN; on CUDA the sliding
pools' null blocks are poisoned too, since its kernels start at each query's window and never read a let-go entry.
The MLX backend and the interpreter read every entry of a context (masked), which is why let-go entries name a null
block that nothing writes: its zeros are checked at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_arch_gemma import HAS_TRITON, NEW, WINDOW, make_hf, prompt
from tiny_hf import assert_close, hf_greedy, hf_logits, saved_models

from core.kv_layout import NULL_BLOCK
from core.sampling_params import SamplingParams
from frontend.engine.engine import EngineConfig, LLMEngine
from frontend.engine.scheduler import SchedulerConfig

BS, CHUNK = 4, 8
PROMPTS = (7 * WINDOW, 5 * WINDOW + 1)  # several windows long, not a multiple of the block size
SLIDING_NEED = -(-(WINDOW + CHUNK) // BS) + 1  # core.kv_layout.KVGroup.blocks_per_seq: during a prefill chunk
KEPT = -(-WINDOW // BS) + 1  # after a decode step: the window's keys, straddling block edges


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_models(tmp_path_factory, make_hf, load=True)


def make_backend(kind: str, loaded):
    if kind == "cuda-cpu":
        if not HAS_TRITON:
            pytest.skip("triton is not installed")
        from backends.cuda.backend import CUDABackend

        return CUDABackend(loaded, device="cpu", progress=False, dtype="f32")
    from backends.mlx.backend import MLXBackend

    return MLXBackend(loaded, progress=False, compile=kind == "mlx-compiled")


def caches(backend, layers):
    """(k, v) of each of `layers` as [blocks, block_size, ...] views to poison or read."""
    if isinstance(backend.kv[0][0], torch.Tensor):  # CUDA: [blocks, block_size, heads, dim] already
        return [tuple(t.numpy() for t in backend.kv[i]) for i in layers]
    return [tuple(np.array(a).reshape(-1, BS, *a.shape[1:]) for a in backend.kv[i]) for i in layers]


def poison_free_blocks(backend, blocks, null_too: bool) -> None:
    for grp, pool in zip(blocks.layout.groups, blocks.pools, strict=True):
        ids = sorted(pool.free) + ([NULL_BLOCK] if null_too and grp.slides else [])
        if not ids:
            continue
        for layer in grp.layers:
            for i in range(2):
                arr = backend.kv[layer][i]
                if isinstance(arr, torch.Tensor):
                    arr[ids] = float("nan")
                else:  # mlx [slots, heads, dim]: the blocks' slots
                    from backends.mlx.runtime import mx

                    slots = (np.asarray(ids)[:, None] * BS + np.arange(BS)).ravel()
                    arr[mx.array(slots.astype(np.int32))] = mx.nan
                    mx.eval(arr)


def hf_logprobs(model, ids: list[int], out: list[int]) -> np.ndarray:
    """transformers' log-probabilities over the vocabulary at each generated position, [len(out), vocab]."""
    logits = torch.from_numpy(hf_logits(model, ids + out[:-1])[len(ids) - 1:])
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("kind", ["mlx", "mlx-compiled", "cuda-cpu"])
@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_sliding_layers_hold_only_their_window(case, kind, saved):
    model, _, loaded = saved(case)
    backend = make_backend(kind, loaded)
    engine = LLMEngine(backend, EngineConfig(block_size=BS, num_kv_blocks=64, prefix_caching=False, scheduler=
                                             SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                             prefill_chunk_size=CHUNK)))
    layout = engine.blocks.layout
    assert [g.window for g in layout.groups] == [None, WINDOW]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=4)
    prompts = [prompt(i + 1, n) for i, n in enumerate(PROMPTS)]
    rids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[r].seqs[0] for r in rids]
    held: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(seqs))}  # (context, full, sliding)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        for i, s in enumerate(seqs):
            if s.kv[0].table:
                held[i].append((s.num_computed_tokens, *(len(g.table) - g.num_freed for g in s.kv)))
        poison_free_blocks(backend, engine.blocks, null_too=kind == "cuda-cpu")
    assert engine.all_blocks_free()
    for i, (ids, rid) in enumerate(zip(prompts, rids, strict=True)):
        out = done[rid]
        assert out.token_ids == hf_greedy(model, ids, NEW)
        ref = hf_logprobs(model, ids, out.token_ids)
        ours = np.array([lp.logprob for lp in out.logprobs])
        assert_close(ours, ref[np.arange(NEW), out.token_ids])
        top = np.array([[p for _, p in lp.top] for lp in out.logprobs])
        assert_close(top, np.sort(ref, axis=-1)[:, ::-1][:, :4])
        steps = held[i]
        assert all(sliding <= SLIDING_NEED for _, _, sliding in steps)
        decoding = [(ctx, full, sliding) for ctx, full, sliding in steps if ctx >= len(ids)]
        assert all(full == -(-ctx // BS) and sliding <= KEPT for ctx, full, sliding in decoding)
        ctx, full, sliding = steps[-1]  # the context near its end: 14-15 and 11-12 blocks, against 2-3
        assert ctx >= len(ids) + NEW - 2 and full >= 3 * sliding
    if kind != "cuda-cpu":  # MLX reads let-go entries (masked): their null block must still hold zeros
        for k, v in caches(backend, layout.groups[1].layers):
            assert not np.any(k[NULL_BLOCK]) and not np.any(v[NULL_BLOCK])
