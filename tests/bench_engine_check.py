"""A synthetic GGUF file through the engine tools/bench_gguf's ours stage builds (engine_over), over MLX's CPU
backend, against the interpreter: 4 greedy tokens of two prompts (the shape tests of tools/synth_gguf_*)."""

from __future__ import annotations

from tiny_hf import random_prompt

from ir.loader import load_model
from ir.reference import ReferenceRunner


def bench_engine_matches_interpreter(path, vocab: int) -> None:
    from backends.mlx.backend import MLXBackend
    from core.sampling_params import SamplingParams
    from tools.bench_gguf_stages import engine_over

    model = load_model(path, progress=False)
    prompts = [random_prompt(8, 6, vocab), random_prompt(9, 13, vocab)]
    engine = engine_over(MLXBackend(model, progress=False), max_batch=2, max_len=64)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id=str(i))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    want = ReferenceRunner(model, max_tokens=64).greedy(prompts, 4)[0]
    assert [got[str(i)] for i in range(len(prompts))] == want
