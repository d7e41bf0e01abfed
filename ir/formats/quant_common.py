"""Arithmetic shared by the GGUF quantizers, written to round exactly as ggml's C reference does in float32, and the
slab loop every quantizer (GGUF, int4, fp8) runs in.

Every array here is float32 and every sum is sequential (np.add.accumulate), because ggml's reference quantizers add
in index order without reassociation: numpy's pairwise `sum` would round differently and pick other quants."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

F32 = np.float32
# Values quantized per call: the k-quant searches hold a few dozen temporaries of this size.
CHUNK_ELEMS = 1 << 18
# Slabs quantized at once: numpy lets go of the GIL inside its loops, so threads share out a large tensor.
THREADS = min(8, os.cpu_count() or 1)
# ggml-quants.c's GROUP_MAX_EPS: a group whose largest |x| is below it is all zero.
GROUP_MAX_EPS = F32(1e-15)


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even through the 1.5 * 2^23 trick, bit for bit (also where ggml's assert,
    off in release builds, would fire), as int64."""
    val = np.asarray(v, dtype=F32) + F32(12582912.0)
    return (val.view(np.int32).astype(np.int64) & 0x007FFFFF) - 0x00400000


def seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in index order, as a C loop `s += a[i]` does in float32 (whole columns at a time:
    np.add.accumulate over a short last axis is several times slower)."""
    cols = np.moveaxis(np.asarray(a, dtype=F32), -1, 0)
    s = cols[0].copy()
    for c in cols[1:]:
        s += c
    return s


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 values (n,) as their fp16 (round to nearest even, as GGML_FP32_TO_FP16) little-endian bytes (n, 2)."""
    return np.asarray(v, dtype=F32).astype("<f2").reshape(-1, 1).view(np.uint8)


def f16_round(v: np.ndarray) -> np.ndarray:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)): what a scale is worth once stored."""
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def abs_max_signed(x: np.ndarray) -> np.ndarray:
    """Per row, the value of largest magnitude with its sign (the first such, as ggml's `ax > amax` loop keeps)."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)[..., 0]


def pack_crumbs(L: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K 2-bit packing: L (n, 256) values 0..3 -> (n, 64) bytes; byte j/4 + l of each 128-half holds
    L[j+l], L[j+l+32], L[j+l+64], L[j+l+96] at bits 0, 2, 4, 6."""
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(-1, 64)


def pack_nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two equally shaped arrays of 4-bit values as bytes lo | hi << 4."""
    return (lo.astype(np.uint8) & 0xF) | ((hi.astype(np.uint8) & 0xF) << 4)


def by_rows(m: np.ndarray, step: int, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """fn over slabs of `step` rows of m, concatenated: bounded temporaries, and THREADS threads share them out."""
    slabs = [m[i:i + step] for i in range(0, m.shape[0], step)]
    if len(slabs) == 1:
        return fn(m)
    with ThreadPoolExecutor(THREADS) as pool:
        return np.concatenate(list(pool.map(fn, slabs)), axis=0)
