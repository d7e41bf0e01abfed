"""How an engine request fails, whichever side of a process boundary the engine runs on (serving.py maps each to
its HTTP status: 503, 500, 500)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine is gone (its thread or process ended): the request cannot complete."""


class StepFailedError(RuntimeError):
    """A step failed in the backend: the requests in it fail, the engine goes on."""


class RequestFailedError(RuntimeError):
    """This request alone failed (its sampling raised); the engine and the other requests go on."""
