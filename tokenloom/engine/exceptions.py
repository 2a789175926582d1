"""Errors the engine front ends raise to their callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process died or its loop raised); nothing more will run.

    Every in-flight ``generate()`` raises it, and so does every later call.
    """

    def __init__(self, message: str = "the engine core has died; restart the engine") -> None:
        super().__init__(message)
