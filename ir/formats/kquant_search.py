"""The k-quants' scale searches (ggml-quants.c's make_qkx2_quants, make_qx_quants, make_q3_quants), vectorized over
groups: x is (groups, n) float32, and each group takes the path the C code takes for it, with the same float32
operations in the same order, so the quants and scales come out bit-identical."""

from __future__ import annotations

import numpy as np

from ir.formats.quant_common import F32, GROUP_MAX_EPS, abs_max_signed, nearest_int, seqsum


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric quants L in 0..nmax with scale and min (x ~ scale * L - min) minimizing the weighted error over
    nstep + 1 trial scales. Returns (L int64 (g, n), scale (g,), the_min (g,))."""
    mn = np.minimum(x.min(axis=1), F32(0))
    mx = x.max(axis=1)
    sum_w, sum_x = seqsum(w), seqsum(w * x)
    flat = mx == mn
    with np.errstate(all="ignore"):  # flat groups divide by zero; their result is replaced below
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        L = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)

        def error(s: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
            diff = (s[:, None] * q.astype(F32) + m[:, None]) - x
            return seqsum(w * (np.abs(diff) if use_mad else diff * diff))

        best = error(scale, mn, L)
        for i in range(nstep + 1):
            # ggml moves `min` to each better trial's, and the next trial's range and offsets follow it.
            isc = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / (mx - mn)
            la = np.clip(nearest_int(isc[:, None] * (x - mn[:, None])), 0, nmax)
            lf = la.astype(F32)
            wl = w * lf
            sum_l, sum_l2, sum_xl = seqsum(wl), seqsum(wl * lf), seqsum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            cur = error(this_scale, this_min, la)
            take = (D > 0) & (cur < best)
            L = np.where(take[:, None], la, L)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
    L = np.where(flat[:, None], 0, L)
    scale = np.where(flat, F32(0), scale).astype(F32)
    return L, scale, (-mn).astype(F32)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quants L in 0..2*nmax-1 (x ~ scale * (L - nmax)) with x^2-weighted scale refinement over 18 trial
    scales (make_qx_quants with rmse_type 1 and no importance weights, as Q6_K calls it). Returns (L, scale)."""
    mx = abs_max_signed(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    w = x * x
    with np.errstate(all="ignore"):

        def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            lq = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
            lf = lq.astype(F32)
            return lq + nmax, seqsum(w * x * lf), seqsum(w * lf * lf)

        L, sumlx, suml2 = trial(-F32(nmax) / mx)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for i in range(-9, 10):
            if i == 0:
                continue
            lq, slx, sl2 = trial(-(F32(nmax) + F32(0.1) * F32(i)) / mx)
            take = (sl2 > 0) & (slx * slx > best * sl2)
            L = np.where(take[:, None], lq, L)
            scale = np.where(take, slx / sl2, scale)
            best = np.where(take, scale * slx, best)
    L = np.where(zero[:, None], 0, L)
    return L, np.where(zero, F32(0), scale).astype(F32)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quants L in 0..2*nmax-1 refined one element at a time for up to five passes (make_q3_quants with
    do_rmse, as Q3_K calls it). Returns (L, scale). A pass that changes nothing leaves the state as it was, so
    running all five passes on every group equals ggml's early exit."""
    mx = abs_max_signed(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(all="ignore"):
        L = np.clip(nearest_int((-F32(nmax) / mx)[:, None] * x), -nmax, nmax - 1)
        lf = L.astype(F32)
        sumlx, suml2 = seqsum(wx * lf), seqsum(w * lf * lf)
        for _ in range(5):
            for i in range(x.shape[1]):
                li = L[:, i].astype(F32)
                slx = sumlx - wx[:, i] * li
                sl2 = suml2 - w[:, i] * li * li
                new = np.clip(nearest_int(x[:, i] * sl2 / slx), -nmax, nmax - 1)
                nf = new.astype(F32)
                slx = slx + wx[:, i] * nf
                sl2 = sl2 + w[:, i] * nf * nf
                take = (sumlx - wx[:, i] * li > 0) & (new != L[:, i]) & (sl2 > 0) & \
                    (slx * slx * suml2 > sumlx * sumlx * sl2)
                L[:, i] = np.where(take, new, L[:, i])
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L = np.where(zero[:, None], 0, L + nmax)
    return L, np.where(zero, F32(0), scale).astype(F32)
