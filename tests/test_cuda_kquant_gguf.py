"""A tiny llama GGUF whose matrices are random valid Q4_K and Q6_K blocks (the types of a Q4_K_M file) through the
CUDA backend against the IR reference interpreter, at batch sizes that take each quantized path: 2 rows the GEMV, 6
and 12 the int8 MMQ GEMM (kernels_src/gguf_mmq.py), 40 the dequantizing GEMM (as do prefills of 33-256 rows).
Without a GPU the int8 paths run under Triton's interpreter (the runner takes them on the "triton" target only:
gguf_linear.I8_TARGETS is widened here for that); x's int8 quantization moves the logits by ~0.5%."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from backend_greedy import backend_greedy
from gguf_write import write_kquant_llama

from ir.loader import load_model
from ir.reference import ReferenceRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
torch = pytest.importorskip("torch")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320
# of max |logit|: x quantized to int8 per 32 elements (llama.cpp's q8_1), twice a layer. Batch 2's 23-row prefill is
# the one case whose first logits come through the MMQ: 3.8% on an H200 (2026-12-01); the others' prefills take
# dequant_gemm (fp x) and stay far below.
TOL = 0.05
# per256 (the default MMQ variant since 2026-12-03) quantizes x per 256 elements, about 2x per32's error from x:
# the 23-row prefill at batch 2 read 5.2% on an H200 (per32 3.7% on this CPU), so its bound is 8%.
VARIANT_TOL = {"per256": 0.08}


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    """Q4_K for q, k, o, gate, up; Q6_K for v, down and the head (as llama-quantize's Q4_K_M does, roughly)."""
    path = tmp_path_factory.mktemp("kq") / "kq.gguf"
    write_kquant_llama(path, np.random.default_rng(7), HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB, 256,
                       lambda n: np.ones(n, np.float32))
    return path


CASES = [("cpu", 6)] + [pytest.param("cuda", b, marks=DEVICES[1].marks) for b in (2, 6, 12, 40)]


@pytest.mark.parametrize("device,batch", CASES)
def test_kquant_model_at_every_path(device, batch, kquant_file, monkeypatch):
    """On the CPU one case (a minute under Triton's interpreter): 6 rows decode through the MMQ, the prefill's
    ~40 through dequant_gemm. On a GPU every path."""
    from backends.cuda import gguf_linear
    from backends.cuda.backend import CUDABackend
    from backends.cuda.weights import QuantWeight
    from kernels_src import gguf_mmq

    if device == "cpu":
        monkeypatch.setattr(gguf_linear, "I8_TARGETS", (*gguf_linear.I8_TARGETS, "triton-interpret"))
    calls, real = [], gguf_mmq.mmq
    monkeypatch.setattr(gguf_linear, "mmq", lambda x2, w, qtype, **kw: calls.append((x2.shape[0], qtype)) or
                        real(x2, w, qtype, **kw))
    model = load_model(kquant_file, progress=False)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, VOCAB, 20 if i == 0 else 2 + i % 5).tolist() for i in range(batch)]
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    _, ref_first = ref.greedy(prompts, 2)
    backend = CUDABackend(model, device=device, dtype="f32", cuda_graph=False, progress=False)
    assert {p.qtype for p in backend.params.values() if isinstance(p, QuantWeight)} == {"Q4_K", "Q6_K"}
    _, first = backend_greedy(backend, ref, prompts, 2, 8)
    err = float(np.abs(first - ref_first).max())
    tol = VARIANT_TOL.get(gguf_mmq.MMQ_VARIANT, TOL)  # where the MMQ computes the first logits, its x error
    assert err <= tol * float(np.abs(ref_first).max()), err
    decode_rows = {m for m, _ in calls}
    if gguf_linear.MMQ_MIN_ROWS["Q4_K"] <= batch <= gguf_mmq.MAX_ROWS:
        assert batch in decode_rows and {q for _, q in calls} == {"Q4_K", "Q6_K"}
    else:
        assert batch not in decode_rows
