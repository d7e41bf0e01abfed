"""Another GPU's (or a fresh sweep's) tiles for the quantized GEMMs without editing code: LLM_ENGINE_GEMM_TUNED names
a `tools/sweep_gemm --json` file (or several, joined by os.pathsep: the first naming a problem holds it), whose best
setting per problem takes precedence over dequant_gemm.TUNED and int_group_gemm.TUNED (as LLM_ENGINE_GEMV_TUNED does
for the GEMV). Each module keys the rows by its own row buckets."""

from __future__ import annotations

import functools
import json
import os
import re

TUNED_ENV = "LLM_ENGINE_GEMM_TUNED"
INT_TYPE = re.compile(r"int(\d+)g(\d+)")


@functools.cache
def sweep_rows() -> tuple[dict, ...]:
    """The best row of each problem in the files TUNED_ENV names (read once), fewest rows first (a stable sort: the
    files' order within): ({type, m, n, k, variant, tiles}, ...); () without the variable. A file that is not such a
    table is a ValueError naming it."""
    best = []
    for path in filter(None, os.environ.get(TUNED_ENV, "").split(os.pathsep)):
        try:
            rows = json.loads(open(path).read())["results"]
            best += [dict(type=str(r["type"]), m=int(r["m"]), n=int(r["n"]), k=int(r["k"]), variant=str(r["variant"]),
                          tiles=dict(r["tiles"])) for r in rows if r.get("best") and r.get("tiles")]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{TUNED_ENV}={path}: not a sweep_gemm --json table ({e})") from e
    return tuple(sorted(best, key=lambda r: r["m"]))


def table(key_of) -> dict:
    """{key_of(row): {variant, **tiles}} over sweep_rows, where key_of gives a module's key (None: not its row); a
    bucket's first row (the fewest rows of x) holds it, as sweep_gemm's printed literals do."""
    out: dict = {}
    for r in sweep_rows():
        key = key_of(r)
        if key is not None:
            out.setdefault(key, dict(variant=r["variant"], **r["tiles"]))
    return out
