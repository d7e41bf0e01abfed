"""Every registry kernel as a problem on a CUDA GPU: random inputs built on the device (valid GGUF blocks included,
without the gguf package), one call of its host launcher for a target, and a check against the kernel's numpy
reference on CPU copies (a sample of rows / sequences where the whole would be slow). Outputs start as NaN, so an
unwritten element fails. Shared by tools/bench_kernels.py and tests/test_kernels_gpu.py; needs torch only when a
case is built."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from kernels_src import (
    activations,
    dequant_gemm,
    dequant_gemv,
    dequant_gemv_i8,
    dequantize,
    kv_write,
    rms_norm,
    rope,
    rope_kv_write,
)
from tools.kernel_case_base import OUT_EPS, Case, Dev, combine, compare, gguf_weights, host, written
from tools.kernel_cases_attention import (
    mla_decode_case,
    paged_decode_case,
    paged_decode_reduce_case,
    paged_prefill_case,
)
from tools.kernel_cases_dense import dense_gemm_case, dense_gemv_case
from tools.kernel_cases_fp8 import fp8_gemm_case, fp8_gemv_case
from tools.kernel_cases_int_group import int_group_dequantize_case, int_group_gemm_case, int_group_gemv_case
from tools.kernel_cases_moe import moe_align_case, moe_case, moe_route_case

# --- rows of a hidden state ---------------------------------------------------------------------------------------

def _rms_norm(d: Dev, p: dict, fused: bool) -> Case:
    rows, n, dt = p["rows"], p["hidden"], d.dtype(p["dtype"])
    x, r = d.randn((rows, n), dt), d.randn((rows, n), dt)
    w = (1.0 + d.randn((n,), d.torch.float32, 0.1)).to(dt)
    s_out, out = d.nan((rows, n), dt), d.nan((rows, n), dt)

    def prepare(target):
        s_out.fill_(float("nan"))
        out.fill_(float("nan"))

    def launch(target):
        if fused:
            rms_norm.add_rms_norm(x, r, w, 1e-6, sum_out=s_out, out=out, target=target)
        else:
            rms_norm.rms_norm(x, w, 1e-6, out=out, target=target)

    def check():
        i = d.sample(rows)
        if not fused:
            return combine(written("out", out), compare("out", host(out[i]), rms_norm.rms_norm_ref(
                host(x[i]), host(w), 1e-6), p["dtype"]))
        s_ref, o_ref = rms_norm.add_rms_norm_ref(host(x[i]), host(r[i]), host(w), 1e-6)
        return combine(written("outputs", s_out, out), compare("sum_out", host(s_out[i]), s_ref, p["dtype"]),
                       compare("out", host(out[i]), o_ref, p["dtype"]))

    return Case("add_rms_norm" if fused else "rms_norm", p, launch, check, prepare)


def _rope_inputs(d: Dev, p: dict, max_pos: int = 8192):
    """qkv [T, Hq + 2 Hkv, D] (q, k, v are views into it, as the backends hold them), its copy, cos, sin, positions
    (rotary_dim: head_dim unless p says)."""
    torch, half = d.torch, p.get("rotary_dim", p["head_dim"]) // 2
    qkv = d.randn((p["tokens"], p["q_heads"] + 2 * p["kv_heads"], p["head_dim"]), d.dtype(p["dtype"]))
    inv = 10000.0 ** (-torch.arange(half, device=d.dev, dtype=torch.float32) / half)
    angles = torch.arange(max_pos, device=d.dev, dtype=torch.float32)[:, None] * inv[None, :]
    pos = torch.randint(0, max_pos, (p["tokens"],), device=d.dev, dtype=torch.int32, generator=d.gen)
    return qkv, qkv.clone(), angles.cos(), angles.sin(), pos


def _rope(d: Dev, p: dict) -> Case:
    t, hq, hk, torch = p["tokens"], p["q_heads"], p["kv_heads"], d.torch
    qkv, orig, cos, sin, pos = _rope_inputs(d, p)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]

    def check():
        i = d.sample(t)
        o, got, ps, c, s = host(orig[i]), host(qkv[i]), host(pos)[i], host(cos), host(sin)
        v_same = bool(torch.equal(qkv[:, hq + hk:], orig[:, hq + hk:]))
        return combine(compare("q", got[:, :hq], rope.rope_ref(o[:, :hq], ps, c, s), p["dtype"]),
                       compare("k", got[:, hq:hq + hk], rope.rope_ref(o[:, hq:hq + hk], ps, c, s), p["dtype"]),
                       (0.0, None) if v_same else (np.inf, "v (past q and k) was written"))

    return Case("rope", p, lambda target: rope.rope(q, k, pos, cos, sin, target=target), check,
                lambda target: qkv.copy_(orig))


def _silu_mul(d: Dev, p: dict) -> Case:
    t, inner, dt = p["tokens"], p["inner"], d.dtype(p["dtype"])
    gate_up = d.randn((t, 2 * inner), dt, 2.0)  # the fused projection's halves, as views
    gate, up, out = gate_up[:, :inner], gate_up[:, inner:], d.nan((t, inner), dt)

    def check():
        i = d.sample(t)
        want = activations.gated_act_ref(host(gate[i]), host(up[i]), "silu")
        return combine(written("out", out), compare("out", host(out[i]), want, p["dtype"]))

    return Case("silu_mul", p, lambda target: activations.gated_act(gate, up, "silu", out=out, target=target), check,
                lambda target: out.fill_(float("nan")))


def _kv_write(d: Dev, p: dict) -> Case:
    t, h, dim, bs, dt = p["tokens"], p["kv_heads"], p["head_dim"], p.get("block_size", 16), d.dtype(p["dtype"])
    kv = d.randn((t, 2 * h, dim), dt)
    k, v = kv[:, :h], kv[:, h:]  # strided views, as out of a qkv split
    n_blocks = 2 * -(-t // bs) + 1
    slots = d.perm(n_blocks * bs)[:t].to(d.torch.int64)
    if p.get("padding"):
        slots[::7] = -1  # padding tokens: skipped
    kc, vc = d.nan((n_blocks, bs, h, dim), dt), d.nan((n_blocks, bs, h, dim), dt)

    def check():
        kr, vr = (np.full(tuple(kc.shape), np.nan, np.float32) for _ in range(2))
        kv_write.kv_write_ref(host(k), host(v), kr, vr, host(slots))
        bad = [n for n, got, want in (("k_cache", kc, kr), ("v_cache", vc, vr))
               if not np.array_equal(host(got), want, equal_nan=True)]
        return (0.0, None) if not bad else (np.inf, f"{', '.join(bad)} differ from the reference (exact copy)")

    def prepare(target):
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))

    return Case("kv_write", p, lambda target: kv_write.kv_write(k, v, kc, vc, slots, target=target), check, prepare)


def _rope_kv_write(d: Dev, p: dict) -> Case:
    """q and both caches bit for bit against rope then kv_write of the same target on copies (run in prepare), q also
    against rope_ref; k and v themselves untouched. Every 7th token is padding (slot -1)."""
    t, hq, hk, bs, torch = p["tokens"], p["q_heads"], p["kv_heads"], p.get("block_size", 16), d.torch
    inter = p.get("interleaved", False)
    qkv, orig, cos, sin, pos = _rope_inputs(d, p)
    ref, n_blocks = orig.clone(), 2 * -(-t // bs) + 1
    slots = d.perm(n_blocks * bs)[:t].to(torch.int64)
    slots[::7] = -1
    caches = [d.nan((n_blocks, bs, hk, p["head_dim"]), qkv.dtype) for _ in range(4)]  # fused k, v; unfused k, v
    views = lambda x: (x[:, :hq], x[:, hq:hq + hk], x[:, hq + hk:])
    bits = lambda x: x.view({2: torch.int16, 4: torch.int32}[x.element_size()])  # bit patterns: NaN equals NaN

    def prepare(target):
        qkv.copy_(orig)
        ref.copy_(orig)
        for c in caches:
            c.fill_(float("nan"))
        rope.rope(*views(ref)[:2], pos, cos, sin, interleaved=inter, target=target)
        kv_write.kv_write(*views(ref)[1:], *caches[2:], slots, target=target)

    def check():
        i = d.sample(t)
        differ = [n for n, a, b in (("q", qkv[:, :hq], ref[:, :hq]), ("k_cache", caches[0], caches[2]),
                                    ("v_cache", caches[1], caches[3])) if not torch.equal(bits(a), bits(b))]
        want_q = rope.rope_ref(host(orig[i, :hq]), host(pos)[i], host(cos), host(sin), inter)
        return combine(compare("q", host(qkv[i, :hq]), want_q, p["dtype"]),
                       (0.0, None) if torch.equal(qkv[:, hq:], orig[:, hq:]) else (np.inf, "k or v was written"),
                       (np.inf, f"{', '.join(differ)} differ from rope + kv_write's") if differ else (0.0, None))

    return Case("rope_kv_write", p, lambda target: rope_kv_write.rope_kv_write(
        *views(qkv), *caches[:2], slots, pos, cos, sin, interleaved=inter, target=target), check, prepare)


# --- dequantizing GEMV ----------------------------------------------------------------------------------------------

def _gemv(d: Dev, p: dict, name: str) -> Case:
    """`int8_x` in p picks the path (default: the launcher's for the target). The int8-activation path is checked
    twice: against x's int8 quantization (quantize_x_ref) at the fp path's tolerance, and against x itself within
    the bound that quantization allows (int8_error_bound) plus the output dtype's rounding."""
    m, n, k, qtype, dt = p["m"], p["n"], p["k"], p["qtype"], d.dtype(p["dtype"])
    w, x, y = gguf_weights(d, qtype, n, k, padded=p.get("padded", False)), d.randn((m, k), dt), d.nan((m, n), dt)
    ran = {}

    def launch(target):
        ran["int8"] = dequant_gemv_i8.uses_int8(qtype, target, p.get("int8_x"))
        return dequant_gemv.dequant_gemv(x, w, qtype, out=y, target=target, int8_x=p.get("int8_x"))

    def check():
        i = d.sample(n)
        xh, wh, got = host(x), host(w[i]), host(y[:, i])
        want = dequant_gemv.dequant_gemv_ref(xh, wh, qtype)
        if not ran.get("int8"):
            return combine(written("y", y), compare("y", got, want, p["dtype"]))
        xq = dequant_gemv_i8.dequantize_x(*dequant_gemv_i8.quantize_x_ref(xh))
        want_q = dequant_gemv.dequant_gemv_ref(xq, wh, qtype)
        bound = dequant_gemv_i8.int8_error_bound(xh, wh, qtype) + OUT_EPS[p["dtype"]] * np.abs(want) \
            + 1e-5 * np.abs(want).max()
        excess = float((np.abs(np.asarray(got, np.float64) - want) / bound).max())
        beyond = (np.inf, f"y: {excess:.2f} x the int8 quantization bound") if excess > 1 else (0.0, None)
        return combine(written("y", y), compare("y", got, want_q, p["dtype"]), beyond)

    return Case(name, p, launch, check, lambda target: y.fill_(float("nan")))


def _gemm(d: Dev, p: dict, name: str) -> Case:
    """dequant_matmul at default tiles unless p names launcher keywords (block_m, block_n, blocks, split_k, swap,
    num_warps, num_stages); columns sampled against the float64 reference."""
    m, n, k, qtype, dt = p["m"], p["n"], p["k"], p["qtype"], d.dtype(p["dtype"])
    w, x, y = gguf_weights(d, qtype, n, k, padded=p.get("padded", False)), d.randn((m, k), dt), d.nan((m, n), dt)
    tiles = {key: p[key] for key in TILE_KEYS if key in p}

    def check():
        i = d.sample(n)
        want = dequant_gemm.dequant_matmul_ref(host(x), host(w[i]), qtype)
        return combine(written("y", y), compare("y", host(y[:, i]), want, p["dtype"]))

    return Case(name, p, lambda target: dequant_gemm.dequant_matmul(x, w, qtype, out=y, target=target, **tiles),
                check, lambda target: y.fill_(float("nan")))


def _mmq(d: Dev, p: dict, name: str) -> Case:
    """gguf_mmq.mmq at its tiles (its variant: p["variant"], per32 when absent); sampled columns against x's int8
    quantization times the float64 dequantization."""
    from kernels_src import gguf_mmq

    m, n, k, qtype, dt = p["m"], p["n"], p["k"], p["qtype"], d.dtype(p["dtype"])
    w, x, y = gguf_weights(d, qtype, n, k), d.randn((m, k), dt), d.nan((m, n), dt)

    variant = p.get("variant", "per32")

    def check():
        i = d.sample(n)
        want = gguf_mmq.mmq_ref(host(x), host(w[i]), qtype, variant)
        return combine(written("y", y), compare("y", host(y[:, i]), want, p["dtype"]))

    return Case(name, p, lambda target: gguf_mmq.mmq(x, w, qtype, out=y, target=target, variant=variant), check,
                lambda target: y.fill_(float("nan")))


TILE_KEYS = ("block_m", "block_n", "blocks", "split_k", "swap", "num_warps", "num_stages")


def _dequantize(d: Dev, p: dict) -> Case:
    """r rows of an n-row GGUF matrix: all of them in order (r = n), else random ids with repeats (`lookup`), as an
    embedding lookup takes them; `padded` rows are views whose trailing bytes decode to NaN if read."""
    r, n, k, qtype, dt = p["r"], p["n"], p["k"], p["qtype"], d.dtype(p["dtype"])
    w, out, torch = gguf_weights(d, qtype, n, k, padded=p.get("padded", False)), d.nan((r, k), dt), d.torch
    if p.get("lookup") or r != n:
        rows = torch.randint(0, n, (r,), device=d.dev, generator=d.gen, dtype=torch.int64)
    else:
        rows = torch.arange(n, device=d.dev, dtype=torch.int32)

    def check():
        i = d.sample(r)
        want = dequantize.dequantize_rows_ref(host(w), host(rows)[i], qtype, k)
        return combine(written("out", out), compare("out", host(out[i]), want, p["dtype"]))

    return Case(f"dequantize_{qtype.lower()}", p,
                lambda target: dequantize.dequantize_rows(w, rows, qtype, k, out=out, target=target), check,
                lambda target: out.fill_(float("nan")))


BUILDERS: dict[str, Callable[[Dev, dict], Case]] = {
    "rms_norm": lambda d, p: _rms_norm(d, p, False), "add_rms_norm": lambda d, p: _rms_norm(d, p, True),
    "rope": _rope, "silu_mul": _silu_mul, "kv_write": _kv_write, "rope_kv_write": _rope_kv_write,
    "paged_decode": paged_decode_case, "paged_decode_reduce": paged_decode_reduce_case,
    "paged_prefill": paged_prefill_case, "mla_decode": mla_decode_case, "moe_route": moe_route_case,
    "moe_align": moe_align_case,
    **{n: functools.partial(moe_case, name=n) for n in ("moe_gemm", "moe_gemm_gguf", "moe_gemv", "moe_gemv_gguf",
                                                    "moe_mmq")},
    "dense_gemm": dense_gemm_case,
    "int_group_gemv": functools.partial(int_group_gemv_case, name="int_group_gemv"),
    "int_group_gemm": functools.partial(int_group_gemm_case, name="int_group_gemm"),
    "int_group_mmq": functools.partial(int_group_gemm_case, name="int_group_mmq"),  # bench's variant="mmq"
    "int_group_dequantize": functools.partial(int_group_dequantize_case, name="int_group_dequantize"),
    "fp8_gemv": functools.partial(fp8_gemv_case, name="fp8_gemv"),
    "fp8_gemm": functools.partial(fp8_gemm_case, name="fp8_gemm"),
}


def has_case(name: str) -> bool:
    return name in BUILDERS or name.startswith(("dequant_gemv_", "dequant_gemm_", "mmq_", "dequantize_", "dense_gemv"))


def build_case(name: str, params: dict, seed: int = 0, device: str = "cuda") -> Case:
    """The GPU problem of registry kernel `name` at `params` (its `bench` keys, plus extras such as ragged)."""
    d = Dev(seed, device)
    if name.startswith("dequant_gemv_"):
        return _gemv(d, params, name)
    if name.startswith("dense_gemv"):
        return dense_gemv_case(d, params, name)
    if name.startswith("dequant_gemm_"):
        return _gemm(d, params, name)
    if name.startswith("mmq_"):
        return _mmq(d, params, name)
    if name.startswith("dequantize_"):
        return _dequantize(d, params)
    if name not in BUILDERS:
        raise KeyError(f"no GPU case for kernel {name!r}")
    return BUILDERS[name](d, params)
