"""The DSL's atomic_add and debug_barrier: tracing rules, the interpreter's semantics against Triton's interpreter
(a grid counting itself done, its last program resetting the counter), the SIMT targets' refusal, and the sm_90
PTX: a release-acquire atomic at GPU scope on one thread, a bar.sync before it."""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as np
import pytest

from kernels_src.dsl import TraceError, tl, trace
from kernels_src.dsl import compile as dsl_compile

HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton/torch not installed")
SIG = {"x": "*i32", "counter": "*i32", "seen": "*i32"}


def count_kernel(x, counter, seen, LIVE: tl.constexpr):
    """Programs below LIVE write x and count themselves done; the last one sums x and resets the counter."""
    i, n = tl.program_id(0), tl.num_programs(0)
    live = i < LIVE
    tl.store(x + i, i + 1, mask=live)
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, mask=live)
    tl.debug_barrier()
    last = live & (done == tl.minimum(n, LIVE) - 1)
    offs = tl.arange(0, 16)
    total = tl.sum(tl.load(x + offs, mask=last & (offs < n), other=0), axis=0)
    tl.store(seen + i, tl.where(last, total, -done - 1), mask=live)
    tl.store(counter, 0, mask=last)


def launch(target: str, grid: int, live: int):
    x, counter, seen = np.zeros(16, np.int32), np.zeros(1, np.int32), np.full(16, 99, np.int32)
    if target != "numpy":
        import torch

        x, counter, seen = (torch.from_numpy(a) for a in (x, counter, seen))
    dsl_compile(count_kernel, target, LIVE=live)[grid](x, counter, seen)
    return [np.asarray(a) for a in (x, counter, seen)]


@pytest.mark.parametrize("target", ["numpy", pytest.param("triton-interpret", marks=needs_triton)])
def test_last_program_sees_every_write_and_resets(target):
    for _ in range(2):  # the counter is back at 0 after each launch
        x, counter, seen = launch(target, 8, 6)
        assert counter[0] == 0
        np.testing.assert_array_equal(x[:8], [1, 2, 3, 4, 5, 6, 0, 0])
        # the masked-off programs neither count nor write; exactly one program saw the others done, and it saw
        # every live write; the others each saw a distinct count
        assert (seen[6:] == 99).all() and (seen[:6] == 21).sum() == 1
        assert sorted(-seen[:6][seen[:6] != 21] - 1) == list(range(5))


@pytest.mark.parametrize("body, match", [
    (lambda c: tl.atomic_add(c + tl.arange(0, 4), 1), "scalar pointer"),
    (lambda c: tl.atomic_add(c.to(tl.pointer_type(tl.int8)), 1), "on i8"),
    (lambda c: tl.atomic_add(c, 1, sem="seq_cst"), "sem 'seq_cst'"),
    (lambda c: tl.atomic_add(c, 1, mask=tl.arange(0, 2) < 1), "scalar pointer, value and mask"),
])
def test_trace_errors(body, match):
    def kern(c):
        body(c)

    with pytest.raises(TraceError, match=match):
        trace(kern, {"c": "*i32"})


def test_simt_targets_refuse_atomics_and_run_barriers():
    with pytest.raises(ValueError, match="does not support atomics"):
        dsl_compile(count_kernel, "metal", LIVE=4).source(signature=SIG)

    def barrier_kernel(x, y):
        offs = tl.arange(0, 64)
        tl.store(y + offs, tl.load(x + offs) + 1)
        tl.debug_barrier()
        tl.store(x + offs, tl.load(y + 63 - offs))

    x, y = np.arange(64, dtype=np.int32), np.zeros(64, np.int32)
    dsl_compile(barrier_kernel, "simt-cpu", num_warps=2)[1](x, y)
    np.testing.assert_array_equal(x, np.arange(64, 0, -1))
    assert "barrier" in dsl_compile(barrier_kernel, "metal").source(signature={"x": "*i32", "y": "*i32"})


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="AOT builds need TRITON_INTERPRET unset")
def test_sm90_ptx(tmp_path, monkeypatch):
    from kernels_src.dsl.triton_target import aot_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    k = dsl_compile(count_kernel, "triton", LIVE=4)
    src = k.source(signature=SIG)
    assert re.search(r'tl\.atomic_add\(counter, \w+, mask=\w+, sem="acq_rel", scope="gpu"\)', src)
    ptx = aot_compile(k.trace(signature=SIG), arch=90).asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines()]
    atom = [i for i, ln in enumerate(lines) if re.search(r"atom\.global\.gpu\.acq_rel\.add\.u32", ln)]
    assert len(atom) == 1 and lines[atom[0]].startswith("@%p")  # one predicated thread per program
    assert any(ln.startswith("bar.sync") for ln in lines[atom[0] - 6:atom[0]])  # the barrier before the release
