"""The FP8 GEMV's and GEMM's GPU cases for tools/kernel_cases.py: random e4m3 bytes (every finite code) with f32 group
scales on the device, checked on sampled rows against the numpy references."""

from __future__ import annotations

import numpy as np

from ir.formats import fp8_blocks
from kernels_src import fp8_gemm as gg
from kernels_src import fp8_gemv as fg
from tools.kernel_case_base import Case, Dev, combine, compare, host, written

TILE_KEYS = ("rows", "block_k", "num_warps")


def fp8_weights(d: Dev, n: int, k: int, group: int):
    """(codes uint8 [n, k], scales f32 [n, k / group]) on the device; NaN codes (0x7F, 0xFF) replaced by 0, scales
    near 1 / (e4m3's spread * sqrt(k)) so that y stays near 1."""
    codes = d.rng.integers(0, 256, (n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = (d.rng.uniform(0.5, 1.5, (n, k // group)) / 64 / np.sqrt(k)).astype(np.float32)
    return d.torch.from_numpy(codes).to(d.dev), d.torch.from_numpy(scales).to(d.dev)


def fp8_gemv_case(d: Dev, p: dict, name: str) -> Case:
    """fp8_gemv at default tiles unless p names launcher keywords (TILE_KEYS)."""
    m, n, k, group, dt = p["m"], p["n"], p["k"], p["group"], d.dtype(p["dtype"])
    (codes, scales), x, y = fp8_weights(d, n, k, group), d.randn((m, k), dt), d.nan((m, n), dt)
    tiles = {key: p[key] for key in TILE_KEYS if key in p}

    def check():
        i = d.sample(n)
        want = fg.fp8_gemv_ref(host(x), host(codes[i]), host(scales[i]))
        return combine(written("y", y), compare("y", host(y[:, i]), want, p["dtype"]))

    return Case(name, p, lambda target: fg.fp8_gemv(x, codes, scales, out=y, target=target, **tiles), check,
                lambda target: y.fill_(float("nan")))


GEMM_KEYS = ("block_m", "block_n", "split_k", "swap", "num_warps", "num_stages")


def fp8_gemm_case(d: Dev, p: dict, name: str) -> Case:
    """fp8_matmul at default tiles unless p names launcher keywords (GEMM_KEYS). The GPU divides by div.full.f32
    (Triton's fp32 `/`), so x's codes are checked against quantize_x_ref allowing a code's neighbour in one in 10^4,
    and y against the float64 product of the codes and scales the GPU's own quantize_x gives (the GEMM's: the same
    kernel on the same x)."""
    m, n, k, group, dt = p["m"], p["n"], p["k"], p["group"], d.dtype(p["dtype"])
    (codes, scales), x, y = fp8_weights(d, n, k, group), d.randn((m, k), dt), d.nan((m, n), dt)
    tiles = {key: p[key] for key in GEMM_KEYS if key in p}
    ran = {}

    def launch(target):
        ran["target"] = target
        gg.fp8_matmul(x, codes, scales, out=y, target=target, **tiles)

    def check():
        xq, xs = (host(t) for t in gg.quantize_x(x, group, target=ran["target"]))
        want_q, want_s = gg.quantize_x_ref(host(x), group)
        steps = np.abs(fp8_blocks.decode(xq) - fp8_blocks.decode(want_q)) > 0
        if np.count_nonzero(steps) > max(1, xq.size // 10**4) or not np.allclose(xs, want_s, rtol=1e-6, atol=0):
            return np.inf, f"x's e4m3 codes: {np.count_nonzero(steps)} of {xq.size} differ from quantize_x_ref"
        i = d.sample(n)
        xv = fp8_blocks.decode(xq).astype(np.float64).reshape(m, -1, group) * xs[..., None]
        wv = fp8_blocks.decode(host(codes[i])).astype(np.float64).reshape(len(i), -1, group)
        want = xv.reshape(m, k) @ (wv * host(scales[i])[..., None]).reshape(len(i), k).T
        return combine(written("y", y), compare("y", host(y[:, i]), want, p["dtype"]))

    return Case(name, p, launch, check, lambda target: y.fill_(float("nan")))
