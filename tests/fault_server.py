"""`python -m tests.fault_server ARGS`: the server of `python -m frontend ARGS`, whose MLX backend fails one step on
demand: when the file named by $FAULT_TRIGGER exists, the next forward removes it and raises.

The patch is made in the engine process alone: multiprocessing's spawn re-imports the parent's main module there,
as __mp_main__, before it runs the engine (the API process must not import a backend)."""

from __future__ import annotations

import os
import sys


def _patch() -> None:
    from backends.mlx.backend import MLXBackend

    forward = MLXBackend.forward

    def faulty_forward(self, batch):
        trigger = os.environ.get("FAULT_TRIGGER")
        if trigger and os.path.exists(trigger):
            os.remove(trigger)
            raise RuntimeError("device lost (injected by tests/fault_server.py)")
        return forward(self, batch)

    MLXBackend.forward = faulty_forward


if __name__ == "__mp_main__":
    _patch()
elif __name__ == "__main__":
    from frontend.cli import main

    sys.exit(main())
