"""What the engine and every backend share, below both: the batch contract (one flat varlen step over a paged KV
cache: batch.py), the KV layout (which layers share a pool, how a budget is split among pools: kv_layout.py),
sampling parameters and the sampler's semantics (sampling_params.py, sampler.py).

The layers: `frontend` -> `backends` -> `kernels_src`, all over `ir` and this package; an import never points
back up (tests/test_import_layers.py checks it). So `core` imports none of the others.
"""
