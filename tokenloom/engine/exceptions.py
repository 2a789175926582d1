"""Errors the engine front ends raise to their callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process died or its loop raised); nothing more will run.

    Every in-flight ``generate()`` raises it, and so does every later call.
    """

    def __init__(self, message: str = "the engine core has died; restart the engine") -> None:
        super().__init__(message)


class CoreDeadError(EngineDeadError):
    """One data-parallel engine core died; the others may still serve (failover)."""

    def __init__(self, engine_index: int, message: str) -> None:
        super().__init__(f"engine core {engine_index}: {message}")
        self.engine_index = engine_index
