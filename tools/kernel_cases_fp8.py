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


FP8_MMA_TOL = {"float32": (1e-3, 5e-3)}  # y of fp32 x: the MMA's own rounding (fp16 / bf16 y: their TOL's covers it)
GEMM_KEYS = ("block_m", "block_n", "split_k", "swap", "num_warps", "num_stages")


def fp8_gemm_case(d: Dev, p: dict, name: str) -> Case:
    """fp8_matmul at default tiles unless p names launcher keywords (GEMM_KEYS). x's codes are checked against
    quantize_x_ref allowing the next code up or down in at most 1% of them: on the H200 (Triton 3.6) 0.01-0.11% of
    the GPU's codes differ from round-to-nearest-even (its approximate fp32 division, and a conversion to e4m3 that
    may round twice), a rounding difference, where a wrong scale, sign or byte would move many codes far. y is checked
    against the float64 product of the codes and scales the GPU's own quantize_x gives (the same kernel on the same
    x), within FP8_MMA_TOL: Hopper's FP8 MMA adds a K step's products at less than fp32's precision (DeepSeek-V3's
    report: ~14 bits; hence the fresh fp32 tile a step), 2.3e-4 of the output on the H200 at 128-input steps."""
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
        differ = xq != want_q
        mag, want_mag = (xq & 0x7F).astype(int), (want_q & 0x7F).astype(int)  # e4m3's magnitudes order as their codes
        sign_flip = ((xq ^ want_q) & 0x80 != 0) & (np.maximum(mag, want_mag) > 1)  # +-0 and the least subnormal aside
        far = differ & (sign_flip | (np.abs(mag - want_mag) > 1))
        if far.any() or np.count_nonzero(differ) > max(1, xq.size // 100) or not np.allclose(xs, want_s, rtol=1e-6,
                                                                                                   atol=0):
            return np.inf, (f"x's e4m3 codes: {np.count_nonzero(differ)} of {xq.size} differ from quantize_x_ref, "
                            f"{np.count_nonzero(far)} by more than the next code")
        i = d.sample(n)
        xv = fp8_blocks.decode(xq).astype(np.float64).reshape(m, -1, group) * xs[..., None]
        wv = fp8_blocks.decode(host(codes[i])).astype(np.float64).reshape(len(i), -1, group)
        want = xv.reshape(m, k) @ (wv * host(scales[i])[..., None]).reshape(len(i), k).T
        return combine(written("y", y), compare("y", host(y[:, i]), want, p["dtype"], FP8_MMA_TOL.get(p["dtype"])))

    return Case(name, p, launch, check, lambda target: y.fill_(float("nan")))
