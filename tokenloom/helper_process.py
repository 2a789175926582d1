"""A helper process for front-end work that must import torch (the front end must not).

``HelperProcess.call(fn, *args)`` runs a module-level function in one spawned
worker process, started on first use, and returns its result or re-raises
its exception (a ``ValueError``'s message intact). The serving front end
checks grammars (xgrammar imports torch) and runs image processors
(transformers' image processing imports torch) this way.

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
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from tokenloom.parent_death import die_with_parent

T = TypeVar("T")


def _init_worker(parent_pid: int) -> None:
    """Pool initializer: SIGKILL this worker when its parent dies (Linux), or exit now if
    the parent is already gone (it may have died before the request took effect)."""
    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(0)


class HelperProcess:
    """One spawned worker process, started by the first ``call``; ``name`` names its
    submitting thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ProcessPoolExecutor | None = None
        # The one thread that submits to the pool (so starts its worker): see the module doc.
        self._submitter: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the helper (``fn`` and the arguments must pickle)."""
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=context,
                    initializer=_init_worker,
                    initargs=(os.getpid(),),
                )
                self._submitter = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            pool, submitter = self._pool, self._submitter
        assert submitter is not None
        return submitter.submit(pool.submit, fn, *args).result().result()

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            if self._submitter is not None:
                self._submitter.shutdown(wait=False)
                self._submitter = None
