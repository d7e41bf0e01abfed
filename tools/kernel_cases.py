"""Every registry kernel as a problem on a CUDA GPU: random inputs built on the device (valid GGUF blocks included,
without the gguf package), one call of its host launcher for a target, and a check against the kernel's numpy
reference on CPU copies (a sample of rows / sequences where the whole would be slow). Outputs start as NaN, so an
unwritten element fails. Shared by tools/bench_kernels.py and tests/test_kernels_gpu.py; needs torch only when a
case is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ir.formats.gguf_quants import QTYPES as GGUF
from kernels_src import activations, dequant_gemv, dequant_gemv_i8, dequantize, kv_write, rms_norm, rope, rope_kv_write
from kernels_src import paged_attention as pa
from kernels_src import paged_prefill as pp
from kernels_src.dsl import compile as dsl_compile
from kernels_src.dsl import elem_stride, tl

# (relative L2 error, largest error over the largest |ref|) an output may show, by its dtype
OUT_EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}  # an output's rounding, relative
TOL = {"float32": (1e-4, 1e-3), "float16": (3e-3, 1e-2), "bfloat16": (1.5e-2, 5e-2)}
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets in a block
SAMPLE = 256  # rows checked on the CPU out of a large output
QUICK = {  # small problems of the same shapes, for a smoke test
    "rms_norm": dict(rows=64), "add_rms_norm": dict(rows=64), "rope": dict(tokens=64), "silu_mul": dict(tokens=16),
    "kv_write": dict(tokens=64), "rope_kv_write": dict(tokens=64), "paged_decode_reduce": dict(batch=4, context=1100),
    "paged_decode": dict(batch=4, context=1100, ragged=True), "paged_prefill": dict(seqs=2, query_len=64, context=300),
    "gemv": dict(n=512), "dequantize": dict(r=512, n=512),
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
    return bench | QUICK[name.split("_")[0] if name.startswith(("dequant_gemv", "dequantize_")) else name]


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


def compare(what: str, got: np.ndarray, want: np.ndarray, dtype: str) -> Verdict:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return np.inf, f"{what}: shape {got.shape} != reference {want.shape}"
    if not np.isfinite(got).all():
        return np.inf, f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite values (unwritten or NaN)"
    scale = max(np.abs(want).max(), 1e-30)
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    worst = float(np.abs(got - want).max() / scale)
    tol_rel, tol_max = TOL[dtype]
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


# --- paged attention ------------------------------------------------------------------------------------------------

def _paged_cache(d: Dev, p: dict, ctxs: np.ndarray):
    """Caches [blocks, bs, Hkv, D] through shuffled block tables; every slot outside the contexts holds NaN."""
    torch, bs, hkv, dim, dt = d.torch, p["block_size"], p["kv_heads"], p["head_dim"], d.dtype(p["dtype"])
    max_blocks = -(-int(ctxs.max()) // bs)
    n_blocks = len(ctxs) * max_blocks + 3
    tables = d.perm(n_blocks)[:len(ctxs) * max_blocks].view(len(ctxs), max_blocks).to(torch.int32)
    kc, vc = d.randn((n_blocks, bs, hkv, dim), dt), d.randn((n_blocks, bs, hkv, dim), dt)
    j = torch.arange(max_blocks * bs, device=d.dev)
    used_slots = (tables.long()[:, j // bs] * bs + j % bs)[j[None, :] < torch.from_numpy(ctxs).to(d.dev)[:, None]]
    unused = torch.ones(n_blocks * bs, dtype=torch.bool, device=d.dev)
    unused[used_slots] = False
    for c in (kc, vc):
        c.view(n_blocks * bs, -1)[unused] = float("nan")
    return kc, vc, tables


def _seq_cache(kc, vc, tables, b: int, n_ctx: int):
    """Sequence b's first n_ctx cache entries as a compact CPU cache with an identity block table."""
    n = -(-n_ctx // kc.shape[1])
    blocks = tables[b, :n].long()
    return host(kc[blocks]), host(vc[blocks]), np.arange(n, dtype=np.int32)[None, :]


def _check_seqs(n: int) -> list[int]:
    return list(range(n)) if n <= 6 else [0, 1, n // 2, n - 1]


def _decode_setup(d: Dev, p: dict):
    b, ctx, hq, dim, dt = p["batch"], p["context"], p["q_heads"], p["head_dim"], d.dtype(p["dtype"])
    ctxs = np.full(b, ctx, np.int32)
    if p.get("ragged"):
        ctxs = d.rng.integers(1, ctx + 1, b).astype(np.int32)
        ctxs[-1] = ctx
    kc, vc, tables = _paged_cache(d, p, ctxs)
    q = d.randn((b, hq + 2 * p["kv_heads"], dim), dt)[:, :hq]  # a strided view, as out of a qkv split
    n_parts = pa.num_partitions(ctx, 512)
    ws = pa.decode_workspace(q, n_parts) if n_parts > 1 else None
    return ctxs, kc, vc, tables, q, d.nan((b, hq, dim), dt), ws, n_parts, dim ** -0.5


def _decode_check(d, p, ctxs, kc, vc, tables, q, out, scale) -> Verdict:
    verdicts = [written("out", out)]
    for b in _check_seqs(len(ctxs)):
        kb, vb, tb = _seq_cache(kc, vc, tables, b, int(ctxs[b]))
        want = pa.paged_decode_ref(host(q[b:b + 1]), kb, vb, tb, ctxs[b:b + 1], scale)
        verdicts.append(compare(f"out[seq {b}]", host(out[b:b + 1]), want, p["dtype"]))
    return combine(*verdicts)


def _paged_decode(d: Dev, p: dict) -> Case:
    ctxs, kc, vc, tables, q, out, ws, _, scale = _decode_setup(d, p)
    ctx_dev = d.torch.from_numpy(ctxs).to(d.dev)

    def launch(target):
        pa.paged_decode(q, kc, vc, tables, ctx_dev, scale, out=out, max_context=p["context"], workspace=ws,
                        target=target)

    return Case("paged_decode", p, launch, lambda: _decode_check(d, p, ctxs, kc, vc, tables, q, out, scale),
                lambda target: out.fill_(float("nan")))


def _paged_decode_reduce(d: Dev, p: dict) -> Case:
    """The split-K reduce alone, over partials that the split decode kernel of the same target wrote."""
    ctxs, kc, vc, tables, q, out, ws, n_parts, scale = _decode_setup(d, p)
    if ws is None:
        raise ValueError(f"context {p['context']} fits one partition: no reduce runs")
    ctx_dev = d.torch.from_numpy(ctxs).to(d.dev)
    bd = max(16, tl.next_power_of_2(p["head_dim"]))

    def prepare(target):
        pa.paged_decode(q, kc, vc, tables, ctx_dev, scale, out=out, max_context=p["context"], workspace=ws,
                        target=target)
        out.fill_(float("nan"))

    def launch(target):
        red = dsl_compile(pa.paged_decode_reduce_kernel, target, HEAD_DIM=p["head_dim"], BLOCK_D=bd, PARTITION=512,
                          BLOCK_P=pa.reduce_block(n_parts))
        red[len(ctxs), p["q_heads"]](*ws, ctx_dev, out, n_parts, elem_stride(out, 0), elem_stride(out, 1))

    return Case("paged_decode_reduce", p, launch,
                lambda: _decode_check(d, p, ctxs, kc, vc, tables, q, out, scale), prepare)


def _paged_prefill(d: Dev, p: dict) -> Case:
    s, ql, ctx, hq, dim, dt = p["seqs"], p["query_len"], p["context"], p["q_heads"], p["head_dim"], d.dtype(p["dtype"])
    q_lens = np.full(s, ql, np.int32)
    ctxs = np.full(s, ctx, np.int32)
    if p.get("ragged"):  # a sequence with nothing new, short chunks, fresh prompts and long cached prefixes
        q_lens = d.rng.integers(0, ql + 1, s).astype(np.int32)
        ctxs = (q_lens + d.rng.integers(0, ctx - ql + 1, s)).astype(np.int32)
        q_lens[0], ctxs[0] = ql, ctx
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kc, vc, tables = _paged_cache(d, p, ctxs)
    q, out, scale = d.randn((int(qs[-1]), hq, dim), dt), d.nan((int(qs[-1]), hq, dim), dt), dim ** -0.5
    ctx_dev, qs_dev = (d.torch.from_numpy(a).to(d.dev) for a in (ctxs, qs))

    def launch(target):
        pp.paged_prefill(q, kc, vc, tables, ctx_dev, qs_dev, scale, out=out, max_query_len=ql, target=target)

    def check():
        verdicts = [written("out", out)]
        for b in sorted({0, s // 2, s - 1}) if s > 4 else range(s):  # the first and last 32 queries of each
            n = int(q_lens[b])
            for i0, i1 in sorted({(0, min(32, n)), (max(0, n - 32), n)}):
                if i1 <= i0:
                    continue
                c1 = int(ctxs[b]) - n + i1  # queries i0..i1 are the last of a context ending at query i1
                kb, vb, tb = _seq_cache(kc, vc, tables, b, c1)
                rows = slice(int(qs[b]) + i0, int(qs[b]) + i1)
                want = pa.paged_attention_ref(host(q[rows]), kb, vb, tb, np.array([c1]), np.array([0, i1 - i0]),
                                              scale)
                verdicts.append(compare(f"out[seq {b}, q {i0}:{i1}]", host(out[rows]), want, p["dtype"]))
        return combine(*verdicts)

    return Case("paged_prefill", p, launch, check, lambda target: out.fill_(float("nan")))


# --- dequantizing GEMV ----------------------------------------------------------------------------------------------

def gguf_weights(d: Dev, qtype: str, n: int, k: int, scale: float = 0.01, padded: bool = False):
    """Random valid GGUF blocks uint8 [n, row_bytes] on the device: random bytes, fp16 scales finite and moderate.
    `padded`: a view into rows with 6 trailing 0xFF bytes (and 2 spare rows), which decode to NaN if read."""
    torch, spec = d.torch, GGUF[qtype]
    nb = k // spec.block_size
    rb = nb * spec.type_size
    blocks = torch.randint(0, 256, (n, nb, spec.type_size), dtype=torch.uint8, device=d.dev, generator=d.gen)
    for off in FP16_FIELDS[qtype]:
        h = ((torch.rand((n, nb), device=d.dev, generator=d.gen) * 2 - 1) * scale).half()
        blocks[:, :, off:off + 2] = h.view(torch.uint8).view(n, nb, 2)
    if not padded:
        return blocks.view(n, rb)
    big = torch.full((n + 2, rb + 6), 0xFF, dtype=torch.uint8, device=d.dev)
    big[:n, :rb] = blocks.view(n, rb)
    return big[:n, :rb]


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
    "paged_decode": _paged_decode,
    "paged_decode_reduce": _paged_decode_reduce, "paged_prefill": _paged_prefill,
}


def has_case(name: str) -> bool:
    return name in BUILDERS or name.startswith(("dequant_gemv_", "dequantize_"))


def build_case(name: str, params: dict, seed: int = 0, device: str = "cuda") -> Case:
    """The GPU problem of registry kernel `name` at `params` (its `bench` keys, plus extras such as ragged)."""
    d = Dev(seed, device)
    if name.startswith("dequant_gemv_"):
        return _gemv(d, params, name)
    if name.startswith("dequantize_"):
        return _dequantize(d, params)
    if name not in BUILDERS:
        raise KeyError(f"no GPU case for kernel {name!r}")
    return BUILDERS[name](d, params)
