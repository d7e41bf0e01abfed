"""The compiled MLX decode step hands the KV caches back when the compiled function raises: later steps work."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams
from tests.test_engine import chat, run


def test_a_raising_compiled_step_leaves_the_caches_usable(smollm, mlx_smollm, make_engine):
    decode = mlx_smollm.decode
    if decode is None:
        pytest.skip("the compiled decode step is off (ENGINE_MLX_COMPILE=0)")
    ids = chat(smollm.tokenizer, "What is the capital of France?")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = make_engine()
    want = run(engine, [ids], [params])[0].outputs[0].token_ids
    engine = make_engine(prefix_caching=False)
    engine.add_request(ids, params)
    engine.step()  # the prefill; the next steps decode through the compiled function
    compiled = decode._fn

    def failing(*args):  # a failure inside the compiled call (a trace error, an allocation that fails)
        raise RuntimeError("compiled step failed")

    decode._fn = failing
    try:
        with pytest.raises(RuntimeError, match="compiled step failed"):
            engine.step()
    finally:
        decode._fn = compiled
    assert mlx_smollm.kv, "the caches were left cleared"
    out = None
    while engine.has_unfinished():
        out = engine.step() or out
    assert out[0].outputs[0].token_ids == want
