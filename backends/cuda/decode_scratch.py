"""The split-K decode's scratch (paged_decode's partial maxima, sums and accumulators) kept by the runner: an eager
step allocated three tensors a layer for it (torch.empty: ~7 us of host time each on an H200's host). Views of one
fp32 buffer, grown when a step needs more; the views of each shape are kept. Sharing it between layers and steps is
safe: everything runs in one stream's order, and with PDL every kernel waits for the one before before it stores
(dsl.use_pdl), so a layer's reduce has read the partials before the next layer's decode writes them. Buffers that
were outgrown stay allocated: a CUDA graph captured on one replays it."""

from __future__ import annotations

from backends.cuda.runtime import torch

ALIGN = 64  # elements between the three arrays' starts: each 16-byte aligned, as a new tensor (Triton's specialization)


class DecodeScratch:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor] = []  # the largest last
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    def __call__(self, q: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(m, den, acc) [B, Hq, parts] x2, [B, Hq, parts, D] for q [B, Hq, D]: paged_decode's `workspace`."""
        key = (*q.shape, parts)
        views = self._views.get(key)
        if views is None:
            b, h, d = q.shape
            n = -(-b * h * parts // ALIGN) * ALIGN
            if not self._buffers or self._buffers[-1].numel() < n * (2 + d):
                self._buffers.append(torch.empty(n * (2 + d), dtype=torch.float32, device=self.device))
                self._views = {}
            buf, size = self._buffers[-1], b * h * parts
            views = self._views[key] = (buf[:size].view(b, h, parts), buf[n:n + size].view(b, h, parts),
                                        buf[2 * n:2 * n + size * d].view(b, h, parts, d))
        return views
