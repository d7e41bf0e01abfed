"""dsl.launch.BoundLaunch, the launch a host launcher keeps per input shapes: on the direct path a later call takes the
first call's C launcher only while its arrays are 16-byte aligned as the first call's were; an unaligned array goes
through Kernel.launch, whose specialization (direct_key) tells it apart. No GPU: Triton's build and C launcher are
replaced by recorders."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_src import rms_norm
from kernels_src.dsl import Plans, compile, int_class
from kernels_src.dsl import launch as dsl_launch
from kernels_src.dsl.triton_target import direct_key


@pytest.fixture
def recorded(monkeypatch):
    """Kernels 'built' for target triton record (grid, specialization, arguments) per path: 'built' (Kernel.launch's)
    and 'direct' (the C launcher's)."""
    calls = []
    monkeypatch.setattr(dsl_launch.Kernel, "_build", lambda self, *a, signature=None: (
        lambda grid, *args: calls.append(("built", grid, direct_key(args), tuple(args))) or "compiled"))
    monkeypatch.setattr(dsl_launch, "direct_launcher", lambda compiled: (
        lambda grid, args: calls.append(("direct", grid, direct_key(args), tuple(args))) or True))
    monkeypatch.setattr(dsl_launch, "DIRECT_LAUNCH", True)
    return calls


def test_bound_launch_takes_the_c_launcher_only_for_aligned_arrays(recorded, monkeypatch):
    torch = pytest.importorskip("torch")
    kern = dsl_launch.Kernel(rms_norm.rms_norm_kernel, "triton", dict(BLOCK=64, OFFSET=False, PDL=False))  # uncached
    launch = kern.bind(3)
    x, w, out = torch.zeros(3, 64), torch.ones(64), torch.zeros(3, 64)
    for _ in range(3):
        launch(x, w, out, 64, 64, 64, 1e-5)
    assert [c[0] for c in recorded] == ["built", "direct", "direct"] and {c[1] for c in recorded} == {(3,)}
    shifted = torch.zeros(3 * 64 + 1)[1:].view(3, 64)  # 4 bytes past an aligned start
    launch(shifted, w, out, 64, 64, 64, 1e-5)
    assert recorded[-1][0] == "built" and isinstance(recorded[-1][2][0], tuple)  # its own specialization
    launch(torch.zeros(3, 64), w, out, 64, 64, 64, 1e-5)  # aligned again: the first call's C launcher
    assert recorded[-1][:2] == ("direct", (3,))
    monkeypatch.setattr(dsl_launch, "DIRECT_LAUNCH", False)  # tools/bench_launch's comparison: Triton's launcher
    launch(x, w, out, 64, 64, 64, 1e-5)
    assert recorded[-1][0] == "built"


def test_direct_path_passes_addresses(recorded, monkeypatch):
    """The C launcher gets each array as its address (an int: Triton's launcher then neither calls data_ptr() nor
    asks the driver about it), every other argument as given; the first call (Kernel.launch's) and, with
    INT_POINTERS off, every call pass the tensors."""
    torch = pytest.importorskip("torch")
    kern = dsl_launch.Kernel(rms_norm.rms_norm_kernel, "triton", dict(BLOCK=64, OFFSET=False, PDL=False))
    launch = kern.bind(3)
    x, w, out = torch.zeros(3, 64), torch.ones(64), torch.zeros(3, 64)
    launch(x, w, out, 64, 64, 64, 1e-5)
    assert recorded[-1][3][0] is x and recorded[-1][3][2] is out
    y = torch.ones(3, 64)  # another array of the same class: the same plan
    launch(y, w, out, 64, 64, 64, 1e-5)
    assert recorded[-1][0] == "direct"
    assert recorded[-1][3] == (y.data_ptr(), w.data_ptr(), out.data_ptr(), 64, 64, 64, 1e-5)
    assert all(type(a) is int for a in recorded[-1][3][:3])
    monkeypatch.setattr(dsl_launch, "INT_POINTERS", False)
    launch(y, w, out, 64, 64, 64, 1e-5)
    assert recorded[-1][0] == "direct" and recorded[-1][3][0] is y and recorded[-1][3][1] is w


def test_bound_launch_off_the_direct_path():
    """Off target triton a bound launch goes through Kernel.launch every time, with correct results."""
    kern = compile(rms_norm.rms_norm_kernel, "numpy", BLOCK=8, OFFSET=False, PDL=False)
    launch = kern.bind(2)
    x, w = np.arange(16, dtype=np.float32).reshape(2, 8), np.ones(8, np.float32)
    out = np.zeros_like(x)
    for _ in range(2):
        launch(x, w, out, 8, 8, 8, 1e-5)
        np.testing.assert_allclose(out, rms_norm.rms_norm_ref(x, w, 1e-5), rtol=1e-6)
    assert launch.key is False


def test_plans_forget_past_their_limit_and_int_classes():
    plans = Plans(limit=2)
    plans.put("a", 1)
    plans.put("b", 2)
    plans.put("c", 3)
    assert dict(plans) == {"c": 3}
    assert [int_class(n) for n in (1, 2, 16, 48, 17, 2**31 + 1, 2**32 + 16)] == [1, 0, 16, 16, 0, 64, 80]
    assert direct_key((7, 32, 1)) == tuple(int_class(n) for n in (7, 32, 1))
