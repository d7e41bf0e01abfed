"""Compiling and launching: `k = compile(fn, target, **constexprs)`, then `k[grid](*args)`.

Runtime parameter types come from the launch arguments (arrays -> pointers of their dtype, int -> i32,
float -> fp32), like Triton's JIT; each new signature is traced once. Compiled kernels are cached by
(target, source, constexprs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from .interpreter import run
from .ir import KernelIR, atomics_free, dtype_of, fp8_free
from .printer import format_kernel
from .tracer import split_params, trace
from .triton_target import direct_key, direct_launcher  # triton itself is imported only when a kernel is built

TARGETS = ("numpy", "triton", "triton-interpret")
# Target "triton": launch compiled kernels through their C launcher (False: always through Triton's JITFunction.run,
# for comparison: tools/bench_launch)
DIRECT_LAUNCH = True
# A BoundLaunch's direct launch passes its arrays as the addresses it reads for the alignment check, not the tensors:
# Triton's C launcher takes an int as the pointer itself, where for a tensor it calls data_ptr() again and asks the
# driver (cuPointerGetAttribute) whether the address is a device one, for each pointer argument (a decode launch has
# up to 16). The first call of a BoundLaunch goes through the checked path. LLM_ENGINE_INT_POINTERS=0: tensors (the
# A/B, tools/bench_launch)
INT_POINTERS = os.environ.get("LLM_ENGINE_INT_POINTERS", "1") != "0"
_compiled: dict[tuple, Callable] = {}
_kernels: dict[tuple, Kernel] = {}


_RECORDING: list | None = None  # the BoundLaunch calls made inside recording()


@contextmanager
def recording():
    """A list of the (BoundLaunch, its arguments) calls made inside, for a caller that replays them (an eager decode
    step's attention, backends/cuda/attention.py: the same launches a step, a few arrays swapped)."""
    global _RECORDING
    outer, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = outer


_ARRAY_TYPES: dict[tuple, str] = {}  # (type, dtype) -> signature of arrays, tensors and numpy scalars


def arg_type(a) -> str:
    """Signature string of one launch argument: "*fp16" for arrays and tensors, "i32"/"i64"/"fp32" for numbers.

    Called for every argument of every launch (an eager decode step of an 8B model launches ~200 kernels of ~13
    arguments), so the common cases are answered by exact type and a cache before the general checks."""
    t = type(a)
    if t is int:
        return "i32" if -2**31 <= a < 2**31 else "i64"
    if t is float:
        return "fp32"
    if t is not bool and (dt := getattr(a, "dtype", None)) is not None:
        sig = _ARRAY_TYPES.get((t, dt))
        if sig is None:
            sig = _ARRAY_TYPES[(t, dt)] = _arg_type(a)
        return sig
    return _arg_type(a)


def _arg_type(a) -> str:
    if isinstance(a, bool | np.bool_):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2**31 <= a < 2**31 else "i64"
    if isinstance(a, float):
        return "fp32"
    if isinstance(a, np.generic):
        return str(dtype_of(a.dtype))
    if hasattr(a, "dtype") and hasattr(a, "shape"):
        return "*" + str(dtype_of(a.dtype))
    raise TypeError(f"cannot pass {type(a).__name__} to a kernel")


def empty(like, shape, dtype=None):
    """A launcher's uninitialised array next to `like` (numpy or torch), of `dtype` ("float32") or like's."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype or like.dtype)
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype) if dtype else like.dtype, device=like.device)


def elem_stride(a, dim: int) -> int:
    """Stride of `dim` in elements, for numpy arrays and torch tensors."""
    if isinstance(a, np.ndarray):
        return a.strides[dim] // a.itemsize
    return int(a.stride(dim))


def _freeze(d: dict) -> tuple:
    return tuple(sorted(d.items()))


class Kernel:
    """A kernel function bound to a target and constexprs; `k[grid](*args)` launches it."""

    def __init__(self, fn, target: str, constexprs: dict, num_warps: int = 4, launch_pdl: bool = False,
                 num_stages: int | None = None):
        if target not in TARGETS and target not in TARGET_HOOKS:
            raise ValueError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")
        self.fn, self.target, self.constexprs, self.num_warps = fn, target, constexprs, num_warps
        self.launch_pdl = launch_pdl  # Triton on CUDA: programmatic dependent launch (see tl.wait_prior_grid)
        self.num_stages = num_stages  # Triton: software-pipelining depth of loops (None: Triton's default)
        self.runtime_params = split_params(fn)[0]
        self._traces: dict[tuple, KernelIR] = {}
        self._launchers: dict[tuple, Callable] = {}  # signature -> launch: a launch must not re-render
        self._direct: dict[tuple, Callable] = {}  # triton_target.direct_key -> C launch of its compiled kernel

    def trace(self, *args, signature: dict | None = None) -> KernelIR:
        """The IR for these launch arguments (or an explicit {name: "*fp32" | "i32" ...} signature)."""
        if signature is None:
            if len(args) != len(self.runtime_params):
                raise TypeError(f"{self.fn.__name__} takes {len(self.runtime_params)} runtime arguments "
                                f"({', '.join(self.runtime_params)}), got {len(args)}")
            signature = {n: arg_type(a) for n, a in zip(self.runtime_params, args, strict=True)}
        key = _freeze(signature)
        if key not in self._traces:
            self._traces[key] = trace(self.fn, signature, self.constexprs)
        return self._traces[key]

    def source(self, *args, signature: dict | None = None) -> str:
        """What the target compiles: Triton source, or the IR text for the numpy interpreter."""
        k = self.trace(*args, signature=signature)
        if self.target == "numpy":
            return format_kernel(k)
        if self.target in TARGET_HOOKS:
            fp8_free(k, self.target)  # the SIMT targets (C, CUDA C, Metal) have no FP8 type
            atomics_free(k, self.target)  # nor atomics
            return TARGET_HOOKS[self.target][0](k, self.num_warps)
        from .triton_target import TritonRenderer

        return TritonRenderer(interpret=self.target == "triton-interpret").render(k)

    def compiled(self, *args, signature: dict | None = None) -> Callable:
        """`launch(grid, *args)` for these arguments' signature, from the cache when it was built before."""
        if signature is None and len(args) == len(self.runtime_params):
            sig = tuple(map(arg_type, args))
            if sig not in self._launchers:
                self._launchers[sig] = self._build(*args)
            return self._launchers[sig]
        return self._build(*args, signature=signature)

    def _build(self, *args, signature: dict | None = None) -> Callable:
        k = self.trace(*args, signature=signature)
        src = self.source(*args, signature=signature)
        key = (self.target, src, _freeze(self.constexprs), self.num_warps, self.launch_pdl, self.num_stages)
        if key not in _compiled:
            if self.target == "numpy":
                _compiled[key] = lambda grid, *a: run(k, grid, *a)
            elif self.target in TARGET_HOOKS:
                _compiled[key] = TARGET_HOOKS[self.target][1](k, self.num_warps)
            else:
                from .triton_target import build

                fn = build(src, k.name, interpret=self.target == "triton-interpret")
                opts = ({"launch_pdl": True} if self.launch_pdl else {}) | (
                    {"num_stages": self.num_stages} if self.num_stages else {})
                _compiled[key] = lambda grid, *a: fn[grid](*a, num_warps=self.num_warps, **opts)
        return _compiled[key]

    def __getitem__(self, grid) -> Callable:
        grid = (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid)
        return lambda *args: self.launch(grid, args)

    def bind(self, grid) -> BoundLaunch:
        """`k[grid]` for a host launcher's plan: launches whose arguments differ only in their arrays' addresses."""
        return BoundLaunch(self, (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid))

    def launch(self, grid: tuple, args: tuple):
        """Launch on `grid`. On CUDA a kernel already compiled for these arguments' specialization is launched
        through its C launcher (triton_target.direct_launcher): the host cost of an eager step's launches."""
        if self.target != "triton" or not DIRECT_LAUNCH:
            return self.compiled(*args)(grid, *args)
        key = direct_key(args)
        fast = self._direct.get(key)
        if fast is not None and fast(grid, args):
            return None
        compiled = self.compiled(*args)(grid, *args)  # Triton's launcher: compiles once, returns the kernel
        if fast is None and compiled is not None:
            self._direct[key] = direct_launcher(compiled) or (lambda grid, args: False)
        return compiled


class Plans(dict):
    """A host launcher's plans (its decisions for inputs of some shapes: a BoundLaunch and its fixed arguments) by
    key, forgotten all at once past `limit` entries: a server's steps come in every token count."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def put(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


def signature(*arrays) -> tuple:
    """Each array's (shape, strides, dtype), None for None: what a plan's key holds of the arrays it was made for
    (torch tensors: numpy arrays' strides are bytes, and their launchers keep no plans)."""
    return tuple([None if a is None else (a.shape, a.stride(), a.dtype) for a in arrays])  # a list: faster


class BoundLaunch:
    """A kernel's launch on a fixed grid, called with arguments that differ from its first call's only in their
    arrays' addresses: the same dtypes, integers and floats (a host launcher keeps one per shapes it has seen). On
    the direct path a later call checks that its arrays are 16-byte aligned, as the first call's were, instead of
    recomputing every argument's specialization (direct_key: ~0.15 us an argument, 20 arguments a decode launch)."""

    __slots__ = ("kernel", "grid", "key", "ptrs", "fast")

    def __init__(self, kernel: Kernel, grid: tuple):
        self.kernel, self.grid = kernel, grid
        self.key: tuple | bool | None = None  # the first call's direct_key; False: no shortcut (not all aligned)
        self.ptrs: tuple[int, ...] = ()  # the arguments that are arrays
        self.fast: Callable | None = None  # the kernel's direct launch for key, once it has one (never replaced)

    def __call__(self, *args):
        if _RECORDING is not None:
            _RECORDING.append((self, args))
        key = self.key
        if key and DIRECT_LAUNCH:
            fast = self.fast
            if fast is None:
                fast = self.fast = self.kernel._direct.get(key)
            if fast is not None:
                addresses, passed = 0, list(args)
                for i in self.ptrs:
                    passed[i] = p = args[i].data_ptr()
                    addresses |= p
                if not addresses & 15 and fast(self.grid, passed if INT_POINTERS else args):
                    return None
        elif key is None:
            self._learn(args)
        return self.kernel.launch(self.grid, args)

    def _learn(self, args: tuple) -> None:
        if self.kernel.target != "triton":
            self.key = False
            return
        key = direct_key(args)  # a tuple in it: an unaligned array or a numpy scalar, specialized by value
        self.key = not any(isinstance(k, tuple) for k in key) and key
        self.ptrs = tuple(i for i, a in enumerate(args) if type(a) not in (int, float, bool)
                          and getattr(a, "data_ptr", None) is not None)


PDL_TARGETS = ("triton",)  # targets that launch kernels as programmatic dependent launches (Hopper and later)


def use_pdl(target: str, pdl: bool | None = None) -> bool:
    """Whether a launcher's kernel is launched with `launch_pdl` on `target` (pdl None: wherever it can be).

    The convention every such kernel follows: a `PDL: tl.constexpr` parameter; when set, every program calls
    `tl.wait_prior_grid()` before its first store and before loading anything an earlier kernel writes (weights and
    tables may be loaded before), then `tl.launch_dependents()`. Waiting in every program keeps the order
    transitive: a kernel two launches later still sees the writes of this one's predecessor."""
    return target in PDL_TARGETS and pdl is not False


def compile(fn, target: str = "numpy", *, num_warps: int = 4, launch_pdl: bool = False,  # noqa: A001
            num_stages: int | None = None, **constexprs) -> Kernel:
    """The kernel `fn` for `target` ("numpy", "triton", "triton-interpret") with its constexpr values; `launch_pdl`
    (target "triton"): launched as a programmatic dependent launch (it may start before the previous kernel ends);
    `num_stages` (target "triton"): the software-pipelining depth Triton gives its loops (None: its default)."""
    key = (fn, target, num_warps, launch_pdl, num_stages, _freeze(constexprs))
    if key not in _kernels:
        _kernels[key] = Kernel(fn, target, constexprs, num_warps, launch_pdl, num_stages)
    return _kernels[key]


def cache_info() -> dict:
    return {"kernels": len(_kernels), "compiled": len(_compiled)}


# --- targets that plug in from other modules (the SIMT emitters: simt_targets.py) ------------------------------
# name -> (render(kernel_ir, num_warps) -> source text, build(kernel_ir, num_warps) -> launch(grid, *args))
TARGET_HOOKS: dict[str, tuple[Callable, Callable]] = {}


def register_target(name: str, render: Callable, build: Callable) -> None:
    TARGET_HOOKS[name] = (render, build)


def register_launcher(name: str, build: Callable) -> None:
    """Give target `name`, rendered here, the launcher of the layer that can run it: the DSL never imports a
    backend, so backends.mlx.metal_kernel registers the "metal" launcher when it is imported."""
    if name not in TARGET_HOOKS:
        raise ValueError(f"unknown target {name!r} (registered: {', '.join(TARGET_HOOKS)})")
    TARGET_HOOKS[name] = (TARGET_HOOKS[name][0], build)
