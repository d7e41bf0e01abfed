"""The launcher of the kernel DSL's "metal" target: runs what kernels_src/dsl/metal_target.py renders through
`mx.fast.metal_kernel`. It needs mlx, so it lives with the MLX backend (kernels_src never imports a backend);
importing this module registers it, after which `kernels_src.dsl.compile(fn, "metal")[grid](*args)` launches.
How pointers map onto MLX's inputs and outputs (and which are updated in place) is metal_target's docstring.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from backends.mlx.runtime import mx
from kernels_src.dsl.ir import PtrType
from kernels_src.dsl.launch import register_launcher
from kernels_src.dsl.metal_target import MLX_DTYPES, metal_program
from kernels_src.dsl.simt import SimtKernel
from kernels_src.dsl.simt_targets import lowered

__all__ = ["MetalKernel", "mlx_wrapped_source"]


class MetalKernel:
    """`launch(grid, *args, verbose=False) -> {pointer name: mx.array}` for every written pointer."""

    def __init__(self, simt: SimtKernel, outputs: set[str] | None = None):
        self.program = p = metal_program(simt, outputs)
        self.simt, self.outputs, self.source, self.header = p.simt, p.outputs, p.source, p.header
        self.fn = mx.fast.metal_kernel(name=simt.name, input_names=list(p.input_names),
                                       output_names=list(p.output_names), source=p.source, header=p.header,
                                       ensure_row_contiguous=True)

    def __call__(self, grid, *args, verbose: bool = False, stream=None) -> dict:
        grid = (grid,) if isinstance(grid, int) else tuple(int(g) for g in grid)
        grid = grid + (1,) * (3 - len(grid))
        inputs, shapes, dtypes, inplace = [], [], [], []
        for p, a in zip(self.simt.params, args, strict=True):
            if not isinstance(p.dtype, PtrType):
                inputs.append(mx.array(a, dtype=getattr(mx, MLX_DTYPES[p.dtype.name])))
            elif p.name in self.outputs:
                shapes.append(tuple(a.shape))
                dtypes.append(a.dtype)
            else:
                inputs.append(a)
                if p.name in self.simt.written:
                    inplace.append((p.name, a))
        if not shapes:
            shapes, dtypes = [(1,)], [mx.int32]
        outs = self.fn(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes,
                       grid=(grid[0] * self.simt.nthreads, grid[1], grid[2]), threadgroup=(self.simt.nthreads, 1, 1),
                       verbose=verbose, **({} if stream is None else {"stream": stream}))
        result = dict(zip(self.program.output_names, outs, strict=True)) if self.outputs else {}
        for name, a in inplace:
            result[name] = mx.depends([a], list(outs))[0]
        return result


def mlx_wrapped_source(kernel: MetalKernel, grid, *args) -> str:
    """The full Metal source MLX builds for this launch (signature + body), as mlx prints it with verbose=True.

    MLX writes it while tracing the call, which works without a Metal device inside `mx.export_function` (it
    records the kernel for another machine instead of running it); its stdout (C++) is captured at the fd level.
    """
    arrays = [a for p, a in zip(kernel.simt.params, args, strict=True) if isinstance(p.dtype, PtrType)]

    def fn(*arrs):
        it = iter(arrs)
        full = [next(it) if isinstance(p.dtype, PtrType) else a for p, a in zip(kernel.simt.params, args, strict=True)]
        return list(kernel(grid, *full, verbose=True).values())

    with tempfile.TemporaryFile(mode="w+b") as out, _stdout_to(out):
        mx.export_function(lambda *_: None, fn, *arrays)
        out.seek(0)
        text = out.read().decode()
    start = text.find("```\n")
    end = text.rfind("```")
    if start < 0 or end <= start:
        raise RuntimeError(f"mlx printed no kernel source:\n{text[:2000]}")
    return text[start + 4:end - 1]  # less the newline mlx prints after the source


@contextlib.contextmanager
def _stdout_to(f):
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(f.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


register_launcher("metal", lambda k, num_warps: MetalKernel(lowered(k, num_warps)))
