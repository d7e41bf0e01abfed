"""What every GPU kernel case shares (tools/kernel_cases.py): the case record, random tensors on the device from
one seed (random valid GGUF blocks among them), CPU copies, and the verdict of outputs against a reference by their
dtype's rounding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ir.formats.gguf_quants import QTYPES as GGUF

# (relative L2 error, largest error over the largest |ref|) an output may show, by its dtype
OUT_EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}  # an output's rounding, relative
TOL = {"float32": (1e-4, 1e-3), "float16": (3e-3, 1e-2), "bfloat16": (1.5e-2, 5e-2)}
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets in a block
SAMPLE = 256  # rows checked on the CPU out of a large output
QUICK = {  # small problems of the same shapes, for a smoke test
    "rms_norm": dict(rows=64), "add_rms_norm": dict(rows=64), "rope": dict(tokens=64), "silu_mul": dict(tokens=16),
    "kv_write": dict(tokens=64), "rope_kv_write": dict(tokens=64), "paged_decode_reduce": dict(batch=4, context=1100),
    "paged_decode": dict(batch=4, context=1100, ragged=True), "paged_prefill": dict(seqs=2, query_len=64, context=300),
    "mla_decode": dict(batch=4, context=1100, ragged=True),
    "gemv": dict(n=512), "dense_gemv": dict(n=512), "dense_gemm": dict(n=512), "gemm": dict(n=512),
    "dequantize": dict(r=512, n=512),
    "moe_gemm": dict(tokens=4, experts=16), "moe_gemm_gguf": dict(tokens=4, experts=16), "moe_route": dict(tokens=4),
    "moe_align": dict(tokens=4),
    "moe_gemv": dict(tokens=2, experts=16), "moe_gemv_gguf": dict(tokens=2, experts=16),
    "moe_mmq": dict(tokens=4, experts=16),
    "int_group_gemv": dict(n=512), "int_group_gemm": dict(n=512), "int_group_mmq": dict(n=512),
    "int_group_dequantize": dict(n=512),
    "fp8_gemv": dict(n=512), "fp8_gemm": dict(m=64, n=512),
}
Verdict = tuple[float, str | None]  # (worst relative error, what is wrong or None)


@dataclass
class Case:
    name: str
    params: dict
    launch: Callable[[str], None]  # one call of the host launcher for a target
    check: Callable[[], Verdict]  # after prepare + launch: the outputs against the reference
    prepare: Callable[[str], None] = lambda target: None  # fresh outputs (and in-place inputs) before a checked run


def quick_params(name: str, bench: dict) -> dict:
    prefixes = {"dequant_gemv": "gemv", "dense_gemv": "dense_gemv", "dequant_gemm": "gemm", "mmq_": "gemm",
                "dequantize_": "dequantize"}
    key = next((v for pre, v in prefixes.items() if name.startswith(pre)), name)
    return bench | QUICK[key]


class Dev:
    """Random tensors on the current CUDA device from one seed, and CPU copies for the references."""

    def __init__(self, seed: int, device: str = "cuda"):
        import torch

        self.torch, self.dev = torch, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.rng = np.random.default_rng(seed)

    def dtype(self, name: str):
        return getattr(self.torch, name)

    def randn(self, shape, dtype, scale: float = 1.0):
        return (self.torch.randn(shape, device=self.dev, generator=self.gen) * scale).to(dtype)

    def nan(self, shape, dtype):
        return self.torch.full(shape, float("nan"), device=self.dev, dtype=dtype)

    def perm(self, n: int):
        return self.torch.randperm(n, device=self.dev, generator=self.gen)

    def sample(self, n: int, k: int = SAMPLE) -> np.ndarray:
        """Indices to check: all of a small range, else both ends and a random spread."""
        if n <= k:
            return np.arange(n)
        return np.unique(np.concatenate([[0, 1, n - 2, n - 1], self.rng.choice(n, k - 4, replace=False)]))


def host(t) -> np.ndarray:
    """A CPU numpy copy: floats as float32 (bf16 has no numpy dtype), integers as they are."""
    return (t.float() if t.is_floating_point() else t).cpu().numpy()


def compare(what: str, got: np.ndarray, want: np.ndarray, dtype: str,
            tol: tuple[float, float] | None = None) -> Verdict:
    """(rel err, None or what is wrong) of `got` against `want` within TOL[dtype] (or `tol`: (rel, max of max|ref|))."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return np.inf, f"{what}: shape {got.shape} != reference {want.shape}"
    if not np.isfinite(got).all():
        return np.inf, f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite values (unwritten or NaN)"
    scale = max(np.abs(want).max(), 1e-30)
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    worst = float(np.abs(got - want).max() / scale)
    tol_rel, tol_max = tol or TOL[dtype]
    if rel > tol_rel or worst > tol_max:
        return rel, f"{what}: rel err {rel:.2e} (tol {tol_rel:g}), max err {worst:.2e} of max|ref| (tol {tol_max:g})"
    return rel, None


def combine(*verdicts: Verdict) -> Verdict:
    errs = [m for _, m in verdicts if m]
    return max(v for v, _ in verdicts), (errs[0] if errs else None)


def written(what: str, *tensors) -> Verdict:
    """Every element of the poisoned outputs written (checked whole, on the device)."""
    bad = sum(int(t.isnan().sum()) for t in tensors)
    return (0.0, None) if not bad else (np.inf, f"{what}: {bad} elements left NaN (unwritten)")


# the spread of random blocks' values per unit of their fp16 scale fields (gguf_weights): scaled by it, the weights
# are about 1 / sqrt(k), so activations stay moderate through an MoE's two GEMMs even in fp16
SPREAD = {"Q4_0": 2.5, "Q4_1": 4.7, "Q5_0": 4.9, "Q5_1": 9.7, "Q8_0": 40.0, "Q2_K": 10.0, "Q3_K": 24.0, "Q4_K": 171.0,
          "Q5_K": 339.0, "Q6_K": 723.0}


def gguf_weights(d: Dev, qtype: str, n: int, k: int, scale: float = 0.01, padded: bool = False, align: int = 1):
    """Random valid GGUF blocks uint8 [n, row_bytes] on the device: random bytes, fp16 scales finite and moderate.
    `padded`: a view into rows with 6 trailing 0xFF bytes (and 2 spare rows), which decode to NaN if read; `align`:
    those rows' stride rounded up to a multiple of it (16: what dequant_gemv's Q4_K and Q5_K loads need)."""
    torch, spec = d.torch, GGUF[qtype]
    nb = k // spec.block_size
    rb = nb * spec.type_size
    blocks = torch.randint(0, 256, (n, nb, spec.type_size), dtype=torch.uint8, device=d.dev, generator=d.gen)
    for off in FP16_FIELDS[qtype]:
        h = ((torch.rand((n, nb), device=d.dev, generator=d.gen) * 2 - 1) * scale).half()
        blocks[:, :, off:off + 2] = h.view(torch.uint8).view(n, nb, 2)
    if not padded:
        return blocks.view(n, rb)
    big = torch.full((n + 2, -(-(rb + 6) // align) * align), 0xFF, dtype=torch.uint8, device=d.dev)
    big[:n, :rb] = blocks.view(n, rb)
    return big[:n, :rb]
