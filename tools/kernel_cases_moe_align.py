"""The GPU case of moe_align's one-launch kernel (tools/kernel_cases.py's BUILDERS): a router's top_k distinct
experts a token, drawn from `used` of the experts (default: all; fewer leave experts empty), grouped on the device;
rows and block_expert exactly as kernels_src/moe.py's `_align` gives them in numpy."""

from __future__ import annotations

import numpy as np

from kernels_src import moe
from tools.kernel_case_base import Case, Dev, host


def moe_align_case(d: Dev, p: dict) -> Case:
    t, e, k, bm = p["tokens"], p["experts"], p["top_k"], p["block_m"]
    used = p.get("used", e)
    ids = np.stack([d.rng.choice(used, k, replace=False) for _ in range(t)]).astype(np.int32)
    dev_ids = d.torch.from_numpy(ids).to(d.dev)
    out = {}

    def launch(target):
        out["rows"], out["be"] = moe.moe_align(dev_ids, e, bm, target)

    def check():
        rows, be = moe._align(np, ids.reshape(-1).astype(np.int64), e, bm)
        for what, got, want in (("rows", host(out["rows"]), rows), ("block_expert", host(out["be"]), be)):
            if got.shape != want.shape or (got != want).any():
                return np.inf, f"{what}: {int((got != want).sum()) if got.shape == want.shape else 'shape'} differ"
        return 0.0, None

    return Case("moe_align", p, launch, check)
