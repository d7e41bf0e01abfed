"""What the shape tests of tools/synth_gguf_* share: a synthetic GGUF file read as llama.cpp reads it, and run
through the engine tools/bench_gguf's ours stage builds."""

from __future__ import annotations

import gguf
from tiny_hf import random_prompt

from ir.loader import load_model
from ir.reference import ReferenceRunner


def tensors_as_llama_cpp_reads_them(path, arch: str, name: str) -> tuple[gguf.GGUFReader, dict, dict]:
    """(reader, dims, types) of the file, after checking its architecture and that every tensor is one llama.cpp's
    table names for `arch` (gguf.MODEL_ARCH's); dims in ggml's order, the fastest dimension first."""
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == name
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    dims, types = {}, {}
    for t in r.tensors:
        base = t.name.removesuffix(".weight")
        assert (f"blk.{{bid}}.{base.split('.', 2)[2]}" if base.startswith("blk.") else base) in known, t.name
        dims[t.name] = tuple(int(d) for d in t.shape)
        types[t.name] = t.tensor_type
    return r, dims, types


def bench_engine_matches_interpreter(path, vocab: int) -> None:
    """4 greedy tokens of two prompts through engine_over over MLX's CPU backend, against the interpreter."""
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
