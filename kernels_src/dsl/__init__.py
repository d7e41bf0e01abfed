"""A tile-level kernel DSL: kernels written once in Python, traced to a small IR, run by a numpy interpreter
(the oracle) or emitted as Triton source (and later Metal / CUDA C). See ir.py for the IR's rules."""

from . import simt_targets, tl  # noqa: F401  (simt_targets registers the simt-cpu, cuda and metal targets)
from .ir import KernelIR
from .launch import PDL_TARGETS, TARGETS, Kernel, cache_info, compile, elem_stride, use_pdl
from .printer import format_kernel
from .tracer import TraceError, trace

__all__ = ["PDL_TARGETS", "TARGETS", "Kernel", "KernelIR", "TraceError", "cache_info", "compile", "elem_stride",
           "format_kernel", "tl", "trace", "use_pdl"]
