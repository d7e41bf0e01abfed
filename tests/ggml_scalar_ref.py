"""A literal scalar port of ggml-quants.c's dequantize_row_* (loops written as in C, Python floats):
an oracle for the GGUF dequantizer that does not share gguf-py's vectorized code."""

from __future__ import annotations

import numpy as np


def _h(b: bytes, off: int) -> float:
    return float(np.frombuffer(b, dtype="<f2", count=1, offset=off)[0])


def _i8(v: int) -> int:
    return v - 256 if v >= 128 else v


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def scalar_block(name: str, b: bytes) -> list[float]:
    y = []
    if name in ("Q4_0", "Q4_1"):
        d = _h(b, 0)
        m = _h(b, 2) if name == "Q4_1" else 0.0
        qs = b[4:] if name == "Q4_1" else b[2:]
        y = [0.0] * 32
        for j in range(16):
            if name == "Q4_0":
                y[j], y[j + 16] = ((qs[j] & 0xF) - 8) * d, ((qs[j] >> 4) - 8) * d
            else:
                y[j], y[j + 16] = (qs[j] & 0xF) * d + m, (qs[j] >> 4) * d + m
    elif name in ("Q5_0", "Q5_1"):
        d = _h(b, 0)
        off = 4 if name == "Q5_1" else 2
        m = _h(b, 2) if name == "Q5_1" else 0.0
        qh = int.from_bytes(b[off : off + 4], "little")
        qs = b[off + 4 :]
        y = [0.0] * 32
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            x0, x1 = (qs[j] & 0xF) | xh0, (qs[j] >> 4) | xh1
            if name == "Q5_0":
                y[j], y[j + 16] = (x0 - 16) * d, (x1 - 16) * d
            else:
                y[j], y[j + 16] = x0 * d + m, x1 * d + m
    elif name == "Q8_0":
        d = _h(b, 0)
        y = [_i8(v) * d for v in b[2:34]]
    elif name == "Q2_K":
        sc, qs, d, dmin = b[0:16], b[16:80], _h(b, 80), _h(b, 82)
        is_ = 0
        for n in range(2):
            q = qs[32 * n : 32 * n + 32]
            for shift in (0, 2, 4, 6):
                for half in range(2):
                    s = sc[is_]
                    is_ += 1
                    dl, ml = d * (s & 0xF), dmin * (s >> 4)
                    y += [dl * ((q[16 * half + e] >> shift) & 3) - ml for e in range(16)]
    elif name == "Q3_K":
        hm, qs, d = b[0:32], b[32:96], _h(b, 108)
        aux = [int.from_bytes(b[96 + 4 * i : 100 + 4 * i], "little") for i in range(3)] + [0]
        km1, km2 = 0x03030303, 0x0F0F0F0F
        tmp = aux[2]
        aux[2] = ((aux[0] >> 4) & km2) | (((tmp >> 4) & km1) << 4)
        aux[3] = ((aux[1] >> 4) & km2) | (((tmp >> 6) & km1) << 4)
        aux[0] = (aux[0] & km2) | (((tmp >> 0) & km1) << 4)
        aux[1] = (aux[1] & km2) | (((tmp >> 2) & km1) << 4)
        scales = [_i8(v) for v in b"".join(a.to_bytes(4, "little") for a in aux)]
        is_, m = 0, 1
        for n in range(2):
            q = qs[32 * n : 32 * n + 32]
            for shift in (0, 2, 4, 6):
                for half in range(2):
                    dl = d * (scales[is_] - 32)
                    is_ += 1
                    for e in range(16 * half, 16 * half + 16):
                        y.append(dl * (((q[e] >> shift) & 3) - (0 if hm[e] & m else 4)))
                m <<= 1
    elif name in ("Q4_K", "Q5_K"):
        d, dmin, sc = _h(b, 0), _h(b, 2), b[4:16]
        qh = b[16:48] if name == "Q5_K" else bytes(32)
        ql = b[48:176] if name == "Q5_K" else b[16:144]
        u1, u2 = 1, 2
        for c in range(4):
            s1, m1 = _scale_min_k4(2 * c, sc)
            s2, m2 = _scale_min_k4(2 * c + 1, sc)
            q = ql[32 * c : 32 * c + 32]
            y += [d * s1 * ((q[e] & 0xF) + (16 if qh[e] & u1 else 0)) - dmin * m1 for e in range(32)]
            y += [d * s2 * ((q[e] >> 4) + (16 if qh[e] & u2 else 0)) - dmin * m2 for e in range(32)]
            u1, u2 = u1 << 2, u2 << 2
    elif name == "Q6_K":
        ql_all, qh_all, d = b[0:128], b[128:192], _h(b, 208)
        sc_all = [_i8(v) for v in b[192:208]]
        for n in range(2):
            ql, qh, sc = ql_all[64 * n :], qh_all[32 * n :], sc_all[8 * n :]
            out = [0.0] * 128
            for e in range(32):
                is_ = e // 16
                q1 = ((ql[e] & 0xF) | (((qh[e] >> 0) & 3) << 4)) - 32
                q2 = ((ql[e + 32] & 0xF) | (((qh[e] >> 2) & 3) << 4)) - 32
                q3 = ((ql[e] >> 4) | (((qh[e] >> 4) & 3) << 4)) - 32
                q4 = ((ql[e + 32] >> 4) | (((qh[e] >> 6) & 3) << 4)) - 32
                out[e] = d * sc[is_ + 0] * q1
                out[e + 32] = d * sc[is_ + 2] * q2
                out[e + 64] = d * sc[is_ + 4] * q3
                out[e + 96] = d * sc[is_ + 6] * q4
            y += out
    else:
        raise AssertionError(name)
    return y
