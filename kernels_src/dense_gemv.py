"""Dense GEMV y[M, N] = x'[M, K] @ W.T (M <= 8) over fp16/bf16 weights, with the op before it as its prologue: DSL
kernel, host launcher, numpy reference.

A decode step's linears are memory bound: W is streamed once, x (M rows of K) is small and read by every program
from L1/L2. So the kernel only has to keep weight loads in flight at copy speed, and the small kernels between the
GEMVs (an RMS norm, a residual add + RMS norm, a gated activation) can run inside it instead, each program
computing the x' it needs from x:
- A program takes ROWS weight rows (unrolled) and walks K BLOCK_K elements a step: a lane loads VEC = 16 bytes of
  each row (8 halves) and the x elements that meet them, every weight load of a step issued before the step's
  arithmetic. Products are summed over the lane's VEC elements each step (in registers); the lanes' sums are
  reduced once at the end, in fp32.
- `RMSNorm`: x' = x * rsqrt(mean(x^2) + eps) * (offset + g). The row's scale multiplies the finished dot product
  (sum_k x g w * rsqrt(..) = rsqrt(..) * sum_k x g w), and its sum of squares is accumulated in the same loop from
  the same x loads: one pass over x, no precomputed scale (a separate kernel is what the prologue removes).
- `AddRMSNorm`: s = x + residual rounded to x's dtype (as add_rms_norm writes it), then RMSNorm of s. The programs
  with program_id 0 also store s (sum_out) as they go: every program reads only x and residual, never sum_out, so
  no program waits for another's write (sum_out must not alias x or residual; the launcher checks).
- `Gated`: x' = act(gate) * up, gate and up the halves of the fused gate_up projection (two strided pointers).
- `residual` (an epilogue): y = x' @ W.T + r, r [M, N] (o_proj's and down's residual add, where no norm follows).
x' stays in fp32 (the unfused ops round it to x's dtype first); accumulation in fp32; y takes out's dtype (x's).
Under PDL (dsl.use_pdl) each step's weight (and norm weight) loads are issued before waiting for x, so the first
step's loads overlap the kernel before; later waits return at once; a last wait before the stores.
Every program needs all of x: x is re-read per program (ROWS rows share it), which the table of tiles balances.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels_src.activations import ACTIVATIONS, _act, gated_act_ref
from kernels_src.dsl import Plans, compile, elem_stride, empty, signature, tl, use_pdl

MAX_ROWS = 8  # x rows (M) the kernel takes: every (weight row, x row) pair has its own accumulator
PROLOGUES = ("none", "rms_norm", "add_rms_norm", "gated")
# (x's and w's shapes, strides and dtypes, the tile overrides, target, pdl) -> (launch on its grid, N, the integer and
# float arguments) of a GEMV with no prologue, residual or out: the host work of a repeated launch is its launch
_PLANS = Plans()


@dataclass(eq=False, slots=True)  # not frozen: ~0.5 us less to make (three a layer)
class RMSNorm:
    """x' = x * rsqrt(mean(x^2) + eps) * (offset + w): the rms_norm before the linear."""

    w: object
    eps: float
    offset: bool = False


@dataclass(eq=False, slots=True)  # not frozen: ~0.5 us less to make (three a layer)
class AddRMSNorm:
    """x' = rms_norm(x + residual); the sum (x's dtype) is written to sum_out (allocated when None)."""

    residual: object
    w: object
    eps: float
    offset: bool = False
    sum_out: object = None


@dataclass(eq=False, slots=True)  # not frozen: ~0.5 us less to make (three a layer)
class Gated:
    """x' = act(gate) * up: x is the fused [M, 2I] projection (gate first), or the gate alone when up is given."""

    act: str = "silu"
    up: object = None


def _prologue_name(p) -> str:
    return {type(None): "none", RMSNorm: "rms_norm", AddRMSNorm: "add_rms_norm", Gated: "gated"}[type(p)]


def dense_gemv_kernel(x, x2, g, s_out, r, w, y, n_rows, n_cols, x_stride, x2_stride, s_stride, r_stride, w_stride,
                      y_stride, eps, M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                      PROLOGUE: tl.constexpr = "none", ACT: tl.constexpr = "silu", OFFSET: tl.constexpr = False,
                      RESIDUAL: tl.constexpr = False, EVEN_K: tl.constexpr = False, PDL: tl.constexpr = False):
    """x2: add_rms_norm's residual or gated's up (else unused); g: the norm weight; s_out: add_rms_norm's sum;
    r: the epilogue's residual. EVEN_K: K is a multiple of BLOCK_K (no masks)."""
    vec = 128 // w.dtype.elem.bits  # a lane's 16 bytes of a weight row
    lanes = BLOCK_K // vec
    norm = PROLOGUE in ("rms_norm", "add_rms_norm")
    pid = tl.program_id(0)
    rows = [pid * ROWS + i for i in range(ROWS)]
    w_rows = [w + tl.minimum(row, n_rows - 1).to(tl.int64) * w_stride for row in rows]
    idx = tl.arange(0, lanes)[:, None] * vec + tl.arange(0, vec)[None, :]
    first = pid == 0

    def body(it, *carry):
        k = it * BLOCK_K + idx
        mask = None if EVEN_K else k < n_cols
        wv = [tl.load(wr + k, mask=mask, other=0.0) for wr in w_rows]  # weights: before the wait
        if norm:
            gv = tl.load(g + k, mask=mask, other=0.0).to(tl.float32)
            gv = gv + 1.0 if OFFSET else gv
        if PDL:
            tl.wait_prior_grid()
        accs, sq = list(carry[:ROWS * M]), list(carry[ROWS * M:])
        for m in range(M):
            xv = tl.load(x + m * x_stride + k, mask=mask, other=0.0).to(tl.float32)
            if PROLOGUE == "add_rms_norm":
                s = (xv + tl.load(x2 + m * x2_stride + k, mask=mask, other=0.0).to(tl.float32)).to(s_out.dtype.elem)
                smask = first if EVEN_K else mask & first
                tl.store(s_out + m * s_stride + k, s, mask=smask)
                xv = s.to(tl.float32)
            if norm:
                sq[m] = sq[m] + tl.sum(xv * xv, axis=1)
                xv = xv * gv
            elif PROLOGUE == "gated":
                xv = _act(xv, ACT) * tl.load(x2 + m * x2_stride + k, mask=mask, other=0.0).to(tl.float32)
            for i in range(ROWS):
                accs[i * M + m] = accs[i * M + m] + tl.sum(wv[i].to(tl.float32) * xv, axis=1)
        return tuple(accs + sq)

    init = tuple(tl.zeros((lanes,), tl.float32) for _ in range(ROWS * M + (M if norm else 0)))
    carry = tl.fori_loop(0, (n_cols + BLOCK_K - 1) // BLOCK_K, body, init)
    if PDL:  # a program whose loop ran no step must wait too (a later wait returns at once)
        tl.wait_prior_grid()
        tl.launch_dependents()
    scale = [tl.rsqrt(tl.sum(carry[ROWS * M + m]) / n_cols + eps) for m in range(M)] if norm else None
    for i, row in enumerate(rows):
        for m in range(M):
            v = tl.sum(carry[i * M + m])
            v = v * scale[m] if norm else v
            if RESIDUAL:
                v = v + tl.load(r + m * r_stride + row, mask=row < n_rows, other=0.0).to(tl.float32)
            tl.store(y + m * y_stride + row, v, mask=row < n_rows)


# --- host side -------------------------------------------------------------------------------------------------

# (N, K, M bucket, prologue) -> tiles, from tools/sweep_dense_gemv on an H200 (its last lines print this table): the
# best of its settings on 2026-12-02 (`--budget 40`; their times against cuBLAS were not kept, so whether the runner
# should take this kernel is still the A/B's to say). Shapes not in it take default_tiles' rule.
TILES: dict[tuple[int, int, int, str], dict] = {
    (6144, 4096, 1, 'none'): {'ROWS': 1, 'BLOCK_K': 2048, 'num_warps': 4},
    (6144, 4096, 1, 'add_rms_norm'): {'ROWS': 2, 'BLOCK_K': 1024, 'num_warps': 4},
    (6144, 4096, 4, 'none'): {'ROWS': 2, 'BLOCK_K': 256, 'num_warps': 1},
    (6144, 4096, 4, 'add_rms_norm'): {'ROWS': 2, 'BLOCK_K': 512, 'num_warps': 2},
    (6144, 4096, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (6144, 4096, 8, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (4096, 4096, 1, 'none'): {'ROWS': 2, 'BLOCK_K': 2048, 'num_warps': 4},
    (4096, 4096, 4, 'none'): {'ROWS': 2, 'BLOCK_K': 512, 'num_warps': 2},
    (4096, 4096, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (28672, 4096, 1, 'none'): {'ROWS': 1, 'BLOCK_K': 2048, 'num_warps': 4},
    (28672, 4096, 1, 'add_rms_norm'): {'ROWS': 2, 'BLOCK_K': 2048, 'num_warps': 8},
    (28672, 4096, 4, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (28672, 4096, 4, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (28672, 4096, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (28672, 4096, 8, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (4096, 14336, 1, 'none'): {'ROWS': 1, 'BLOCK_K': 2048, 'num_warps': 4},
    (4096, 14336, 1, 'gated'): {'ROWS': 2, 'BLOCK_K': 2048, 'num_warps': 8},
    (4096, 14336, 4, 'none'): {'ROWS': 2, 'BLOCK_K': 512, 'num_warps': 2},
    (4096, 14336, 4, 'gated'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (4096, 14336, 8, 'none'): {'ROWS': 8, 'BLOCK_K': 512, 'num_warps': 2},
    (4096, 14336, 8, 'gated'): {'ROWS': 8, 'BLOCK_K': 512, 'num_warps': 2},
    (9216, 3072, 1, 'none'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (9216, 3072, 1, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 1024, 'num_warps': 4},
    (9216, 3072, 4, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (9216, 3072, 4, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (9216, 3072, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (9216, 3072, 8, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (3072, 3072, 1, 'none'): {'ROWS': 2, 'BLOCK_K': 1024, 'num_warps': 4},
    (3072, 3072, 4, 'none'): {'ROWS': 2, 'BLOCK_K': 512, 'num_warps': 2},
    (3072, 3072, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (16384, 3072, 1, 'none'): {'ROWS': 2, 'BLOCK_K': 1024, 'num_warps': 4},
    (16384, 3072, 1, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (16384, 3072, 4, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (16384, 3072, 4, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (16384, 3072, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (16384, 3072, 8, 'add_rms_norm'): {'ROWS': 4, 'BLOCK_K': 256, 'num_warps': 1},
    (3072, 8192, 1, 'none'): {'ROWS': 2, 'BLOCK_K': 2048, 'num_warps': 4},
    (3072, 8192, 1, 'gated'): {'ROWS': 2, 'BLOCK_K': 1024, 'num_warps': 4},
    (3072, 8192, 4, 'none'): {'ROWS': 2, 'BLOCK_K': 512, 'num_warps': 2},
    (3072, 8192, 4, 'gated'): {'ROWS': 2, 'BLOCK_K': 2048, 'num_warps': 4},
    (3072, 8192, 8, 'none'): {'ROWS': 4, 'BLOCK_K': 512, 'num_warps': 2},
    (3072, 8192, 8, 'gated'): {'ROWS': 4, 'BLOCK_K': 1024, 'num_warps': 4},
}


def m_bucket(m: int) -> int:
    """The sweep's M (1, 4, 8) that an M of 1-8 rows takes its tiles from."""
    return 1 if m == 1 else 4 if m <= 4 else 8


def default_tiles(n: int, k: int, m: int, prologue: str = "none") -> dict:
    """ROWS, BLOCK_K, num_warps: the sweep's table, else a rule. The rule: 4 warps, one 16-byte vector of 16-bit
    weights a lane and row a step (BLOCK_K 1024, or K's next power of two if smaller), and more rows a program as M
    grows (x, re-read by every program, costs M / ROWS of the weights' bytes in L1/L2 traffic)."""
    for key in ((n, k, m_bucket(m), prologue), (n, k, m_bucket(m), "none")):
        if key in TILES:
            return dict(TILES[key])
    return dict(ROWS=1 if m == 1 else 2 if m <= 4 else 4, BLOCK_K=max(8, min(1024, tl.next_power_of_2(k))),
                num_warps=4)


def _overlaps(a, b) -> bool:
    """Whether two arrays or tensors share memory (by address range)."""
    def span(t):
        if isinstance(t, np.ndarray):
            lo = t.__array_interface__["data"][0]
            return lo, lo + t.nbytes
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _rows(a):
    """a as [rows, n] (a 1-d a as one row); None stays None."""
    return None if a is None else a[None] if len(a.shape) == 1 else a


def _itemsize(a) -> int:
    return a.itemsize if isinstance(a, np.ndarray) else a.element_size()


def dense_gemv(x, w, *, prologue: RMSNorm | AddRMSNorm | Gated | None = None, residual=None, out=None,
               rows: int | None = None, block_k: int | None = None, num_warps: int | None = None,
               target: str = "numpy", pdl: bool | None = None):
    """y [M, N] = prologue(x) [M, K] @ w.T (+ residual [M, N]) for w [N, K] (rows contiguous), M <= 8; x may be
    1-d. Returns y, or (sum_out, y) for AddRMSNorm. y takes out's dtype (x's when out is None)."""
    if type(x) is not np.ndarray and len(x.shape) == 2:  # an eager step's GEMVs: these shapes' checks, tiles and
        # kernel were settled before (its plan)
        got, key = _planned(x, w, prologue, residual, out, (rows, block_k, num_warps, target, pdl))
        if got is not None:
            launch, args, y = got
            launch(*args)
            return y
    else:
        key = None
    x2d, name = _rows(x), _prologue_name(prologue)
    x2 = g = s_out = None  # what the prologue reads besides x (residual or up, the norm weight) and writes
    eps = 0.0
    if name == "gated":
        if prologue.act not in ACTIVATIONS:
            raise ValueError(f"unknown activation {prologue.act!r} (known: {', '.join(ACTIVATIONS)})")
        half = x2d.shape[1] // 2
        x2d, x2 = (x2d[:, :half], x2d[:, half:]) if prologue.up is None else (x2d, _rows(prologue.up))
    elif name != "none":
        g, eps = prologue.w, float(prologue.eps)
    m, k = x2d.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_ROWS or len(w.shape) != 2 or w.shape[1] != k or elem_stride(w, 1) != 1 \
            or elem_stride(x2d, 1) != 1:
        raise ValueError(f"x [{m}, {k}] and w {tuple(w.shape)} (rows contiguous) do not make a GEMV of "
                         f"1-{MAX_ROWS} rows")
    if name == "add_rms_norm":
        x2 = _rows(prologue.residual)
        s_out = empty(x2d, (m, k)) if prologue.sum_out is None else _rows(prologue.sum_out)
        if _overlaps(s_out, x2d) or _overlaps(s_out, x2):
            raise ValueError("AddRMSNorm's sum_out may not alias x or residual: other programs still read them")
    y2d, r = empty(x2d, (m, n)) if out is None else _rows(out), _rows(residual)
    for what, a, shape in (("the prologue's second input", x2, (m, k)), ("sum_out", s_out, (m, k)),
                           ("the norm weight", g, (k,)), ("residual", r, (m, n)), ("out", y2d, (m, n))):
        if a is not None and (tuple(a.shape) != shape or elem_stride(a, len(shape) - 1) != 1):
            raise ValueError(f"{what} is {tuple(a.shape)}, not {shape} with contiguous rows")
    cfg = default_tiles(n, k, m, name)
    cfg.update({key: v for key, v in (("ROWS", rows), ("BLOCK_K", block_k), ("num_warps", num_warps))
                if v is not None})
    nw, vec = cfg.pop("num_warps"), 16 // _itemsize(w)
    if cfg["BLOCK_K"] < vec or cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) or not 1 <= cfg["ROWS"] <= 16:
        raise ValueError(f"tiles {cfg}: BLOCK_K is a power of two of at least {vec} (16 bytes of w), ROWS 1-16")
    pdl = use_pdl(target, pdl)
    kern = compile(dense_gemv_kernel, target, num_warps=nw, launch_pdl=pdl, M=m, PROLOGUE=name,
                   ACT=prologue.act if name == "gated" else "silu", OFFSET=bool(getattr(prologue, "offset", False)),
                   RESIDUAL=r is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, PDL=pdl, **cfg)
    x2, g, s_out, r = (x2d if x2 is None else x2), (w if g is None else g), (y2d if s_out is None else s_out), \
        (y2d if r is None else r)  # pointers the constexprs leave unread
    ints = (n, k, elem_stride(x2d, 0), elem_stride(x2, 0), elem_stride(s_out, 0), elem_stride(r, 0),
            elem_stride(w, 0), elem_stride(y2d, 0), eps)
    launch = kern.bind(tl.cdiv(n, cfg["ROWS"]))
    launch(x2d, x2, g, s_out, r, w, y2d, *ints)
    if key is not None:  # y's strides are those of every later y of these shapes (a new tensor's, as y2d, or out's
        # of the key's strides); and so are sum_out's
        _PLANS.put(key, (launch, n, ints, name))
    one_d = len(x.shape) == 1
    y = out if out is not None else y2d[0] if one_d else y2d
    if name != "add_rms_norm":
        return y
    return (prologue.sum_out if prologue.sum_out is not None else s_out[0] if one_d else s_out), y


def _fused_key(x, w, prologue, residual, rest: tuple) -> tuple | None:
    """A fused GEMV's plan key (None: not planned): the prologue's kind, scalars and arrays' shapes, strides and dtypes
    beside x's, w's, the residual's and a sum_out's, and dense_gemv's other settings (`rest`: out's signature among
    them). A gated prologue's halves of one x take the full path. A caller's sum_out is checked against aliasing x or
    the residual on its shapes' first call only: the runner's are buffers of their own (step_arena)."""
    t = type(prologue)
    if t is Gated:
        if prologue.up is None:
            return None
        own = (prologue.act, signature(prologue.up))
    elif t is RMSNorm:
        own = (prologue.eps, prologue.offset, signature(prologue.w))
    elif t is AddRMSNorm:
        own = (prologue.eps, prologue.offset, signature(prologue.residual, prologue.w, prologue.sum_out))
    else:
        own = ()
    return (t, own, x.shape, x.stride(), x.dtype, w.shape, w.stride(), w.dtype, signature(residual), rest)


def planned(x, w, *, prologue: RMSNorm | AddRMSNorm | Gated | None = None, residual=None, out=None,
            rows: int | None = None, block_k: int | None = None, num_warps: int | None = None, target: str = "numpy",
            pdl: bool | None = None) -> tuple | None:
    """dense_gemv's (launch, its arguments, result) for torch x [M, K] of shapes an earlier call planned, not launched
    (None: no plan yet, dense_gemv makes it). Given out (and AddRMSNorm's sum_out), a caller passing the same arrays
    again (an eager step's kept buffers, backends/cuda/step_arena.py) may call launch(*arguments) again, skipping the
    plan's lookup: the result is those arrays."""
    if type(x) is np.ndarray or len(x.shape) != 2:
        return None
    return _planned(x, w, prologue, residual, out, (rows, block_k, num_warps, target, pdl))[0]


def launched(x, w, **kw) -> tuple:
    """(dense_gemv(x, w, **kw)'s result, (launch, its arguments) or None): a caller passing the same arrays again (an
    eager step's kept buffers) may call launch(*arguments) for the same result; None on the call that plans these
    shapes."""
    got = planned(x, w, **kw)
    if got is None:
        return dense_gemv(x, w, **kw), None
    launch, args, y = got
    launch(*args)
    return y, (launch, args)


def _planned(x, w, prologue, residual, out, opts: tuple) -> tuple:
    """((launch, arguments, result) or None where not planned yet, the plan's key); out's (and sum_out's) shape,
    strides and dtype are in the key: a caller's buffer takes the plan its shapes' first call made, checked then."""
    outs = None if out is None else (out.shape, out.stride(), out.dtype)
    if prologue is None and residual is None:  # a plain linear
        key = (x.shape, x.stride(), x.dtype, w.shape, w.stride(), w.dtype, outs, opts)
    else:
        key = _fused_key(x, w, prologue, residual, (outs, opts))
    if key is None or (plan := _PLANS.get(key)) is None:
        return None, key
    launch, n, ints, name = plan
    y = x.new_empty((x.shape[0], n)) if out is None else out
    r = y if residual is None else residual
    if name == "add_rms_norm":
        s = x.new_empty(x.shape) if prologue.sum_out is None else prologue.sum_out
        return (launch, (x, prologue.residual, prologue.w, s, r, w, y, *ints), (s, y)), key
    # as dense_gemv's first launch: the pointers the constexprs leave unread are x, w or y
    return (launch, (x, prologue.up if name == "gated" else x, w if name in ("none", "gated") else prologue.w, y, r,
                     w, y, *ints), y), key


# --- reference ---------------------------------------------------------------------------------------------------

def _f32(a) -> np.ndarray:
    return np.asarray(a, np.float32)


def prologue_ref(x: np.ndarray, prologue=None) -> tuple[np.ndarray | None, np.ndarray]:
    """(add_rms_norm's sum or None, x' in fp32) for numpy inputs."""
    name = _prologue_name(prologue)
    if name == "gated":
        gate, up = (x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]) if prologue.up is None else (x, prologue.up)
        return None, gated_act_ref(_f32(gate), _f32(up), prologue.act)
    s = None
    xf = _f32(x)
    if name == "add_rms_norm":
        s = (xf + _f32(prologue.residual)).astype(x.dtype)
        xf = _f32(s)
    if name in ("rms_norm", "add_rms_norm"):
        gf = _f32(prologue.w) + (1.0 if prologue.offset else 0.0)
        xf = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(prologue.eps)) * gf
    return s, xf


def dense_gemv_ref(x: np.ndarray, w: np.ndarray, prologue=None, residual=None):
    """y = prologue(x) @ w.T (+ residual) in fp32; (sum, y) for AddRMSNorm, as dense_gemv returns them."""
    s, xf = prologue_ref(x, prologue)
    y = xf @ _f32(w).T
    if residual is not None:
        y = y + _f32(residual)
    return (s, y) if s is not None else y
