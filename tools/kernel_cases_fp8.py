"""The FP8 GEMV's GPU case for tools/kernel_cases.py: random e4m3 bytes (every finite code) with f32 group scales on
the device, checked on sampled rows against the numpy reference."""

from __future__ import annotations

import numpy as np

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
