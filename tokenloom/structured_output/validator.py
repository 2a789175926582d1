"""Checking constraints without importing the grammar backend into the caller.

xgrammar imports torch, and the serving front end must not (its process stays
small and never pays torch's import and memory). ``ConstraintValidator``
with ``in_subprocess=True`` runs ``backend_xgrammar.validate`` in one helper
process, started on the first structured request; the offline ``LLM``, whose
process holds the model anyway, validates in place.

The helper must not outlive its parent, SIGKILL included: on Linux it asks
for ``PR_SET_PDEATHSIG``. Linux sends that signal when the *thread* that
started the process exits, and a process pool starts its worker from the
thread that submits, so every submission goes through one thread of our own
that lives as long as the pool.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from tokenloom.parent_death import die_with_parent
from tokenloom.structured_output.params import StructuredOutputsParams


def _validate(params: StructuredOutputsParams) -> None:
    from tokenloom.structured_output.backend_xgrammar import validate

    validate(params)


def _init_worker(parent_pid: int) -> None:
    """Pool initializer: SIGKILL this worker when its parent dies (Linux), or exit now if
    the parent is already gone (it may have died before the request took effect)."""
    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(0)


class ConstraintValidator:
    """Raises ``ValueError`` naming the field for a constraint the backend cannot enforce."""

    def __init__(self, in_subprocess: bool) -> None:
        self.in_subprocess = in_subprocess
        self._pool: ProcessPoolExecutor | None = None
        # The one thread that submits to the pool (so starts its worker): see the module doc.
        self._submitter: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, params: StructuredOutputsParams) -> None:
        if not self.in_subprocess:
            _validate(params)
            return
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=context,
                    initializer=_init_worker,
                    initargs=(os.getpid(),),
                )
                self._submitter = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-validator")
            pool, submitter = self._pool, self._submitter
        assert submitter is not None
        # The ValueError raised there is re-raised here, message intact.
        submitter.submit(pool.submit, _validate, params).result().result()

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            if self._submitter is not None:
                self._submitter.shutdown(wait=False)
                self._submitter = None
