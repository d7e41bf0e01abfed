"""What the engine and every backend share, below both: sampling parameters and the sampler's semantics.

The layers: `frontend` -> `backends` -> `kernels_src`, all over `ir` and this package; an import never points
back up (tests/test_import_layers.py checks it). So `core` imports none of the others.
"""
