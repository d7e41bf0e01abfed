"""A tile-level kernel DSL: kernels written once in Python, traced to a small IR, run by a numpy interpreter
(the oracle) or emitted as Triton source (and later Metal / CUDA C). See ir.py for the IR's rules."""

from . import simt_targets, tl  # noqa: F401  (simt_targets registers the simt-cpu, cuda and metal targets)
from .ir import KernelIR
from .launch import PDL_TARGETS, TARGETS, Kernel, Plans, cache_info, compile, elem_stride, empty, signature, use_pdl
from .printer import format_kernel
from .tracer import TraceError, trace
from .triton_target import int_class

__all__ = ["PDL_TARGETS", "TARGETS", "Kernel", "KernelIR", "Plans", "TraceError", "cache_info", "compile",
           "elem_stride", "empty", "format_kernel", "int_class", "signature", "tl", "trace", "use_pdl"]
