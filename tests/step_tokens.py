"""The engine's clock in the scheduler's cost model: the tokens each step computed, no wall time."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def counted_steps(backend):
    """The backend's real forward, each batch's token count appended to the yielded list (its running sum is the
    clock a stream's gaps are read on)."""
    computed: list[int] = []
    forward = backend.forward

    def counting_forward(batch):  # the real forward; only its size is written down
        computed.append(batch.num_tokens)
        return forward(batch)

    backend.forward = counting_forward
    try:
        yield computed
    finally:
        del backend.forward
