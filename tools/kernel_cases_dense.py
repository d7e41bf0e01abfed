"""The dense GEMV's and GEMM's GPU cases for tools/kernel_cases.py (and the GEMV's inputs, which
tools/sweep_dense_gemv times): a decode batch through one projection (the GEMV's with its prologue), checked on
sampled columns against the numpy reference."""

from __future__ import annotations

from kernels_src import dense_gemm as dgm
from kernels_src import dense_gemv as dg
from tools.kernel_case_base import Case, Dev, combine, compare, host, written


def dense_inputs(d: Dev, m: int, n: int, k: int, prologue: str, dtype, act: str = "silu", residual: bool = False):
    """(x, w, prologue object, residual or None) on the device: W scaled by 1 / sqrt(k), so y stays near 1; x is
    [m, 2k] (gate | up) for the gated prologue."""
    x = d.randn((m, 2 * k if prologue == "gated" else k), dtype)
    w = d.randn((n, k), dtype, k ** -0.5)
    g = (1.0 + d.randn((k,), d.torch.float32, 0.1)).to(dtype)
    pro = {"none": None, "rms_norm": dg.RMSNorm(g, 1e-5), "gated": dg.Gated(act),
           "add_rms_norm": dg.AddRMSNorm(d.randn((m, k), dtype), g, 1e-5)}[prologue]
    return x, w, pro, d.randn((m, n), dtype) if residual else None


def _host_prologue(p):
    if isinstance(p, dg.AddRMSNorm):
        return dg.AddRMSNorm(host(p.residual), host(p.w), p.eps, p.offset)
    if isinstance(p, dg.RMSNorm):
        return dg.RMSNorm(host(p.w), p.eps, p.offset)
    return p


def dense_gemv_case(d: Dev, p: dict, name: str) -> Case:
    """`prologue` (the entry's), `residual` (the epilogue) and `act` from p; launcher keywords rows, block_k and
    num_warps where p names them."""
    m, n, k, dt = p["m"], p["n"], p["k"], d.dtype(p["dtype"])
    x, w, pro, res = dense_inputs(d, m, n, k, p["prologue"], dt, p.get("act", "silu"), p.get("residual", False))
    y = d.nan((m, n), dt)
    s_out = d.nan((m, k), dt) if isinstance(pro, dg.AddRMSNorm) else None
    if s_out is not None:
        pro = dg.AddRMSNorm(pro.residual, pro.w, pro.eps, sum_out=s_out)
    tiles = {key: p[key] for key in ("rows", "block_k", "num_warps") if key in p}

    def prepare(target):
        y.fill_(float("nan"))
        if s_out is not None:
            s_out.fill_(float("nan"))

    def check():
        i = d.sample(n)
        want = dg.dense_gemv_ref(host(x), host(w[i]), _host_prologue(pro), None if res is None else host(res[:, i]))
        if s_out is None:
            return combine(written("y", y), compare("y", host(y[:, i]), want, p["dtype"]))
        return combine(written("outputs", y, s_out), compare("sum_out", host(s_out), want[0], p["dtype"]),
                       compare("y", host(y[:, i]), want[1], p["dtype"]))

    return Case(name, p, lambda target: dg.dense_gemv(x, w, prologue=pro, residual=res, out=y, target=target,
                                                      **tiles), check, prepare)


GEMM_KEYS = ("block_m", "block_n", "block_k", "split_k", "swap", "num_warps", "num_stages")


def dense_gemm_case(d: Dev, p: dict) -> Case:
    """dense_matmul at default tiles unless p names launcher keywords (GEMM_KEYS); sampled columns against the
    float64 reference."""
    m, n, k, dt = p["m"], p["n"], p["k"], d.dtype(p["dtype"])
    x, w, y = d.randn((m, k), dt), d.randn((n, k), dt, k ** -0.5), d.nan((m, n), dt)
    tiles = {key: p[key] for key in GEMM_KEYS if key in p}

    def check():
        i = d.sample(n)
        return combine(written("y", y), compare("y", host(y[:, i]), dgm.dense_matmul_ref(host(x), host(w[i])),
                                                p["dtype"]))

    return Case("dense_gemm", p, lambda target: dgm.dense_matmul(x, w, out=y, target=target, **tiles), check,
                lambda target: y.fill_(float("nan")))
