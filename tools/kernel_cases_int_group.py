"""The integer-group kernels' GPU cases for tools/kernel_cases.py: random valid blocks (fp16 scales, zero points) on
the device, the GEMV, the GEMM and the dequantization checked on sampled rows against the numpy reference."""

from __future__ import annotations

import numpy as np

from ir.formats import int_groups
from kernels_src import int_group_gemm as igm
from kernels_src import int_group_gemv as ig
from kernels_src import int_group_gemv_i8 as i8
from kernels_src import int_group_mmq as mq
from tools.kernel_case_base import OUT_EPS, Case, Dev, combine, compare, host, written


def int_group_weights(d: Dev, n: int, k: int, bits: int, group: int):
    """uint8 blocks [n, row_bytes] on the device; scales near 1 / sqrt(k) so that y stays near 1."""
    q = d.rng.integers(0, 1 << bits, (n, k))
    scales = (d.rng.uniform(0.5, 1.5, (n, k // group)) * 2.0 / (1 << bits) / np.sqrt(k)).astype(np.float16)
    zeros = d.rng.integers(0, 1 << bits, (n, k // group))
    blocks = int_groups.pack(q, scales.astype(np.float32), zeros, bits, group)
    return d.torch.from_numpy(blocks).to(d.dev)


def int_group_gemv_case(d: Dev, p: dict, name: str) -> Case:
    """`int8_x` in p picks the path (default: the launcher's for the target). The int8-activation path is checked
    against what it computes from quantize_x_i8_ref's x at the dtype's tolerance, and against x itself within
    int8_error_bound plus the output dtype's rounding."""
    m, n, k, bits, group, dt = p["m"], p["n"], p["k"], p["bits"], p["group"], d.dtype(p["dtype"])
    w, x, y = int_group_weights(d, n, k, bits, group), d.randn((m, k), dt), d.nan((m, n), dt)
    ran = {}

    def launch(target):
        ran["int8"] = i8.uses_int8(target, p.get("int8_x"))
        return ig.int_group_gemv(x, w, bits, group, out=y, target=target, int8_x=p.get("int8_x"))

    def check():
        i = d.sample(n)
        xh, wh, got = host(x), host(w[i]), host(y[:, i])
        want = ig.int_group_gemv_ref(xh, wh, bits, group)
        if not ran.get("int8"):
            return combine(written("y", y), compare("y", got, want, p["dtype"]))
        want_q = i8.gemv_i8_ref(*i8.quantize_x_i8_ref(xh, bits), wh, bits, group)
        bound = i8.int8_error_bound(xh, wh, bits, group) + OUT_EPS[p["dtype"]] * np.abs(want) \
            + 1e-5 * np.abs(want).max()
        excess = float((np.abs(np.asarray(got, np.float64) - want) / bound).max())
        beyond = (np.inf, f"y: {excess:.2f} x the int8 quantization bound") if excess > 1 else (0.0, None)
        return combine(written("y", y), compare("y", got, want_q, p["dtype"]), beyond)

    return Case(name, p, launch, check, lambda target: y.fill_(float("nan")))


GEMM_KEYS = ("block_m", "block_n", "sub", "groups", "split_k", "swap", "num_warps", "num_stages", "variant", "bk",
             "accs", "prefetch")


def int_group_gemm_case(d: Dev, p: dict, name: str) -> Case:
    """int_group_matmul at default tiles and variant unless p names launcher keywords (GEMM_KEYS); sampled columns
    against the numpy reference. Variant mmq (int8 x): against its own arithmetic on x quantized by the numpy
    pre-pass at the dtype's tolerance, and against x itself within mmq_error_bound plus the output's rounding."""
    m, n, k, bits, group, dt = p["m"], p["n"], p["k"], p["bits"], p["group"], d.dtype(p["dtype"])
    w, x, y = int_group_weights(d, n, k, bits, group), d.randn((m, k), dt), d.nan((m, n), dt)
    tiles = {key: p[key] for key in GEMM_KEYS if key in p}
    mmq = (tiles.get("variant") or igm.tuned_variant(m, n, k, bits, group)) == "mmq"

    def check():
        i = d.sample(n)
        xh, wh, got = host(x), host(w[i]), host(y[:, i])
        want = igm.int_group_matmul_ref(xh, wh, bits, group)
        if not mmq:
            return combine(written("y", y), compare("y", got, want, p["dtype"]))
        want_q = mq.mmq_ref(*mq.quantize_x_mmq_ref(xh, bits, mq.mmq_step(bits, group, k)), wh, bits, group)
        bound = mq.mmq_error_bound(xh, wh, bits, group) + OUT_EPS[p["dtype"]] * np.abs(want) \
            + 1e-5 * np.abs(want).max()
        excess = float((np.abs(np.asarray(got, np.float64) - want) / bound).max())
        beyond = (np.inf, f"y: {excess:.2f} x the int8 quantization bound") if excess > 1 else (0.0, None)
        return combine(written("y", y), compare("y", got, want_q, p["dtype"]), beyond)

    return Case(name, p, lambda target: igm.int_group_matmul(x, w, bits, group, out=y, target=target, **tiles), check,
                lambda target: y.fill_(float("nan")))


def int_group_dequantize_case(d: Dev, p: dict, name: str) -> Case:
    n, k, bits, group, dt = p["n"], p["k"], p["bits"], p["group"], d.dtype(p["dtype"])
    w, out = int_group_weights(d, n, k, bits, group), d.nan((n, k), dt)

    def check():
        i = d.sample(n)
        want = int_groups.dequantize(host(w[i]), (len(i), k), bits, group)
        return combine(written("out", out), compare("out", host(out[i]), want, p["dtype"]))

    return Case(name, p, lambda target: ig.int_group_dequantize(w, bits, group, k, out=out, target=target), check,
                lambda target: out.fill_(float("nan")))
