"""Grammars for the engine core: compiled off the loop, cached, and turned into bitmasks.

``StructuredOutputManager`` lives in the engine core next to the scheduler.

* ``grammar_init(params)`` starts compiling a request's constraint in a
  thread pool and returns its ``StructuredOutputRequest`` at once; until the
  compile is done the request waits as ``WAITING_FOR_FSM`` and the scheduler
  skips it. Compiled grammars are cached by the constraint (``cache_key``),
  so a schema shared by many requests is compiled once, even when they
  arrive together (they share the pending compile).
* ``grammar_bitmask(...)`` fills one packed bitmask for the structured
  requests of a step (one row per sampled position, draft positions
  included); unstructured requests get no row and cost nothing.
* The xgrammar backend (and the tokenizer it needs) is built on the first
  compile, in the pool, so an engine that never sees a structured request
  never loads it.

No torch here: the bitmask is a numpy int32 array the runner wraps without a copy.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenloom.structured_output.backend_xgrammar import (
    XgrammarBackend,
    XgrammarMatcher,
    bitmask_words,
)
from tokenloom.structured_output.params import StructuredOutputsParams
from tokenloom.structured_output.reasoning_gate import ReasoningPhase

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


@dataclass
class GrammarOutput:
    """The step's bitmask, handed from the engine to the model runner.

    ``grammar_bitmask`` has one row per sampled position of the requests in
    ``structured_output_request_ids``, in that order: ``1 + len(drafts)`` rows
    for a request verifying ``drafts`` this step, else one. A set bit allows
    the token.
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray  # int32 [num_rows, ceil(vocab / 32)]
    rows_per_request: list[int]  # bitmask rows of each request, in order


@dataclass
class StructuredOutputStats:
    """Counted since the previous ``make_stats()``."""

    num_requests: int = 0  # structured requests added
    num_compiles: int = 0  # grammars compiled (cache misses)
    num_cache_hits: int = 0  # requests that reused a cached or pending compile
    compile_times: list[float] = field(default_factory=list)  # seconds per compile


class StructuredOutputRequest:
    """A request's constraint, its (pending) compiled grammar, and its matcher.

    ``reasoning`` follows a reasoning model's thinking: the grammar applies
    only once it ``answering`` (from the first token without a gate).
    """

    __slots__ = ("params", "_future", "_matcher", "_manager", "error", "reasoning")

    def __init__(
        self,
        params: StructuredOutputsParams,
        future: Future[xgr.CompiledGrammar],
        manager: StructuredOutputManager,
    ) -> None:
        self.params = params
        self._future = future
        self._matcher: XgrammarMatcher | None = None
        self._manager = manager
        # Why the grammar could not be compiled (the request cannot run).
        self.error: str | None = None
        self.reasoning = ReasoningPhase(params.reasoning_gate)

    def is_ready(self) -> bool:
        """True once the compile finished, successfully or not (check ``error``)."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        exc = self._future.exception()
        if exc is not None:
            self.error = str(exc)
            return True
        self._matcher = self._manager.new_matcher(self._future.result())
        return True

    @property
    def grammar(self) -> XgrammarMatcher | None:
        """The matcher, or None while compiling (or after a failed compile)."""
        if self._matcher is None:
            self.is_ready()
        return self._matcher

    def accept_output(self, token_ids: list[int]) -> bool:
        """Advance past output already produced (a resumed request): its thinking,
        then the grammar; False when the grammar refuses it."""
        start = self.reasoning.answer_start(token_ids, len(token_ids))
        matcher = self.grammar
        return matcher is not None and matcher.accept_tokens(token_ids[start:])


class StructuredOutputManager:
    """Compiles, caches and applies grammars for one engine core.

    ``tokenizer_factory`` builds the tokenizer on the first compile;
    ``vocab_size`` is the model's (logits) vocabulary, which may exceed the
    tokenizer's; ``stop_token_ids`` end a grammar (the model's EOS ids).
    """

    def __init__(
        self,
        tokenizer_factory: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_cache_entries: int = 512,
        max_workers: int = 1,
    ) -> None:
        if max_cache_entries < 1:
            raise ValueError(f"max_cache_entries must be >= 1, got {max_cache_entries}")
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self._tokenizer_factory = tokenizer_factory
        self._stop_token_ids = list(stop_token_ids)
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tokenloom-grammar")
        self._cache: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = OrderedDict()
        # Reentrant: a compile that already failed runs its done-callback at once.
        self._cache_lock = threading.RLock()
        self._max_cache_entries = max_cache_entries
        self._bitmask = np.empty((0, self.num_words), dtype=np.int32)
        self._stats = StructuredOutputStats()
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------ compiling

    def grammar_init(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start (or reuse) the compile of ``params``; never blocks on it."""
        key = params.cache_key()
        with self._cache_lock:
            future = self._cache.get(key)
            hit = future is not None
            if future is None:
                future = self._executor.submit(self._compile, params)
                self._cache[key] = future
                future.add_done_callback(functools.partial(self._forget_failure, key))
                while len(self._cache) > self._max_cache_entries:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        with self._stats_lock:
            self._stats.num_requests += 1
            if hit:
                self._stats.num_cache_hits += 1
        return StructuredOutputRequest(params, future, self)

    def _forget_failure(self, key: tuple[str, str, bool], future: Future[Any]) -> None:
        """A failed compile is not cached: the next request gets a fresh try."""
        if future.cancelled() or future.exception() is not None:
            with self._cache_lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        backend = self._get_backend()
        started = time.perf_counter()
        compiled = backend.compile(params)
        elapsed = time.perf_counter() - started
        with self._stats_lock:
            self._stats.num_compiles += 1
            self._stats.compile_times.append(elapsed)
        return compiled

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                started = time.perf_counter()
                self._backend = XgrammarBackend(
                    self._tokenizer_factory(), self.vocab_size, self._stop_token_ids
                )
                logger.info(
                    "structured output backend (xgrammar) ready in %.2fs",
                    time.perf_counter() - started,
                )
            return self._backend

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(compiled)

    # ------------------------------------------------------------------ per step

    def grammar_bitmask(
        self,
        structured: Sequence[tuple[str, XgrammarMatcher]],
        spec_tokens: Mapping[str, list[int]],
        also_allowed: Mapping[str, int] | None = None,
    ) -> GrammarOutput:
        """One bitmask for the step: a row per sampled position of each request.

        ``also_allowed`` names, per request, a token its (single) row allows
        besides the grammar's: a reasoning model's optional start of thinking.

        For a request verifying drafts, the matcher steps through the drafts
        to fill the rows after each, then rolls back: it only ever advances
        by tokens the runner accepted (``accept_tokens``). A draft the grammar
        refuses (drafts are validated on arrival, so only in corner cases)
        leaves the rows after it allowing everything; the runner rejects
        that draft anyway, since the token sampled in its place obeys the mask.
        The array is reused across steps: it is valid until the next call.
        """
        num_rows = len(structured)
        if spec_tokens:
            num_rows += sum(len(spec_tokens.get(req_id, ())) for req_id, _ in structured)
        if self._bitmask.shape[0] < num_rows:
            size = max(num_rows, 2 * self._bitmask.shape[0])
            self._bitmask = np.empty((size, self.num_words), dtype=np.int32)
        bitmask = self._bitmask[:num_rows]
        row = 0
        req_ids: list[str] = []
        counts: list[int] = []
        for req_id, matcher in structured:
            req_ids.append(req_id)
            first_row = row
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts:
                advanced = 0
                for token in drafts:
                    matcher.fill_bitmask(bitmask, row)
                    row += 1
                    if not matcher.accept_tokens((token,)):
                        break
                    advanced += 1
                if advanced == len(drafts):
                    matcher.fill_bitmask(bitmask, row)
                    row += 1
                else:
                    end = row + len(drafts) - advanced
                    bitmask[row:end] = -1
                    row = end
                matcher.rollback(advanced)
            else:
                matcher.fill_bitmask(bitmask, row)
                extra = also_allowed.get(req_id) if also_allowed else None
                if extra is not None:
                    word, bit = divmod(extra, 32)
                    bitmask[row, word] |= np.int32(np.uint32(1 << bit).view(np.int32))
                row += 1
            counts.append(row - first_row)
        return GrammarOutput(req_ids, bitmask, counts)

    # ------------------------------------------------------------------ misc

    def make_stats(self) -> StructuredOutputStats:
        with self._stats_lock:
            stats, self._stats = self._stats, StructuredOutputStats()
        return stats

    @property
    def num_cached_grammars(self) -> int:
        with self._cache_lock:
            return len(self._cache)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
