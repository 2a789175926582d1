"""Checking constraints without importing the grammar backend into the caller.

xgrammar imports torch, and the serving front end must not (its process stays
small and never pays torch's import and memory). ``ConstraintValidator``
with ``in_subprocess=True`` runs ``backend_xgrammar.validate`` in one helper
process, started on the first structured request; the offline ``LLM``, whose
process holds the model anyway, validates in place.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor

from tokenloom.structured_output.params import StructuredOutputsParams


def _validate(params: StructuredOutputsParams) -> None:
    from tokenloom.structured_output.backend_xgrammar import validate

    validate(params)


class ConstraintValidator:
    """Raises ``ValueError`` naming the field for a constraint the backend cannot enforce."""

    def __init__(self, in_subprocess: bool) -> None:
        self.in_subprocess = in_subprocess
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, params: StructuredOutputsParams) -> None:
        if not self.in_subprocess:
            _validate(params)
            return
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
            pool = self._pool
        # The ValueError raised there is re-raised here, message intact.
        pool.submit(_validate, params).result()

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
