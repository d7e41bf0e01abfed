"""Gives MLX's Linux CPU build an optimized BLAS.

The `mlx[cpu]` wheel bundles netlib's reference BLAS, whose sgemm runs at 3-6 GFLOP/s on this kind
of machine. libmlx.so resolves `cblas_sgemm` (and d/c gemm) by name, so a tiny shim exporting those
names and forwarding to OpenBLAS (the `scipy-openblas32` wheel, whose symbols carry a `scipy_`
prefix), loaded with RTLD_GLOBAL before mlx, takes its place: 30-70x faster GEMMs, same results up
to summation order. One-row products go to sgemv, which OpenBLAS runs faster than a 1-row sgemm. The
shim is built once with the system C compiler (`make setup` does it; the first import does it too when
a compiler is there) and cached beside this file; a changed source rebuilds it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SHIM_SOURCE = r"""
typedef int blasint;
enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
void scipy_cblas_sgemv(int, int, blasint, blasint, float, const float *, blasint, const float *, blasint, float,
                       float *, blasint);
#define DECLARE(T, name) \
  void scipy_cblas_##name(int, int, int, blasint, blasint, blasint, T, const void *, blasint, const void *, \
                          blasint, T, void *, blasint);
DECLARE(float, sgemm)
DECLARE(double, dgemm)
DECLARE(const void *, cgemm)

/* A one-row product (every decode step at batch 1) is a GEMV: OpenBLAS runs its sgemv much faster
   than a 1-row sgemm (docs/BENCHMARKS.md). Row-major c[1,n] = a[1,k] op(B). */
void cblas_sgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, float alpha, const float *a,
                 blasint lda, const float *b, blasint ldb, float beta, float *c, blasint ldc) {
  if (o == RowMajor && m == 1) {
    blasint inca = ta == NoTrans ? 1 : lda;
    if (tb == Trans) scipy_cblas_sgemv(RowMajor, NoTrans, n, k, alpha, b, ldb, a, inca, beta, c, 1);
    else scipy_cblas_sgemv(RowMajor, Trans, k, n, alpha, b, ldb, a, inca, beta, c, 1);
    return;
  }
  scipy_cblas_sgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#define FORWARD(T, name) \
  void cblas_##name(int o, int ta, int tb, blasint m, blasint n, blasint k, T alpha, const void *a, \
                    blasint lda, const void *b, blasint ldb, T beta, void *c, blasint ldc) { \
    scipy_cblas_##name(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); }
FORWARD(double, dgemm)
FORWARD(const void *, cgemm)
"""

SHIM_PATH = Path(__file__).with_name(f"_openblas_shim_{hashlib.sha1(SHIM_SOURCE.encode()).hexdigest()[:8]}.so")
status = "not loaded"  # what load() did, for logs and the benchmark table


def _openblas_dir() -> Path | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    return Path(scipy_openblas32.get_lib_dir())


def build(dest: Path = SHIM_PATH) -> Path:
    """Compile the shim; raises RuntimeError with the reason when it cannot."""
    lib = _openblas_dir()
    if lib is None:
        raise RuntimeError("scipy-openblas32 is not installed (pip install scipy-openblas32)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "shim.c"
        src.write_text(SHIM_SOURCE)
        out = Path(tmp) / dest.name
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src), f"-L{lib}", "-lscipy_openblas",
               f"-Wl,-rpath,{lib}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling the OpenBLAS shim failed: {res.stderr.strip()[:500]}")
        shutil.move(str(out), dest)
    return dest


def load() -> str:
    """Load the shim (building it if needed) before mlx is imported. Returns a one-line status."""
    global status
    if platform.system() != "Linux" or os.environ.get("ENGINE_MLX_REFERENCE_BLAS"):
        status = "mlx's own BLAS"
        return status
    try:
        path = SHIM_PATH if SHIM_PATH.exists() else build()
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        status = "OpenBLAS (scipy-openblas32)"
    except (RuntimeError, OSError) as e:
        status = "mlx's bundled reference BLAS (slow)"
        log.warning("MLX CPU GEMMs stay on the bundled reference BLAS, which is slow: %s", e)
    return status


if __name__ == "__main__":
    if platform.system() != "Linux":
        print("MLX uses the platform's BLAS here; no shim needed")
    else:
        try:
            print(f"OpenBLAS shim for MLX: {build()}")
        except RuntimeError as e:  # serving still works, only slower: say so and go on
            print(f"warning: MLX CPU GEMMs will use the slow reference BLAS: {e}")
