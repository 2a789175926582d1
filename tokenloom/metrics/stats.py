"""Per-step statistics the front end computes, and the loggers that consume them.

The scheduler produces ``SchedulerStats`` (queue and cache state); the output
processor produces ``IterationStats`` (token counts and latencies measured in
the front end). Every stat logger sees both once per engine step output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tokenloom.metrics.spec_decode import SpecDecodingSummary
from tokenloom.outputs import SchedulerStats
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestTimeline:
    """One request (one of its ``n`` sequences) as the front end saw it: ``time.time()``
    of each event, None until it happened; ``preemption_times``: each time the
    engine core preempted it."""

    request_id: str
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemption_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class FinishedRequestStats:
    """Timings of one finished request (seconds).

    ``queued_time`` runs from arrival to first schedule, ``prefill_time`` from
    first schedule to first token, ``decode_time`` from first token to finish.
    ``timeline`` holds the events themselves; ``sampling_params`` and
    ``trace_headers`` (W3C ``traceparent``/``tracestate`` of the HTTP request)
    are for request tracing.
    """

    finish_reason: str
    e2e_latency: float = 0.0
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    timeline: RequestTimeline | None = None
    sampling_params: SamplingParams | None = None
    trace_headers: Mapping[str, str] | None = None


@dataclass
class IterationStats:
    """What one engine step output delivered to the front end (from core ``engine_index``)."""

    iteration_timestamp: float = field(default_factory=time.time)
    engine_index: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Requests whose first token came in this output: their timelines so far.
    started_requests: list[RequestTimeline] = field(default_factory=list)
    # Engine core start attempts after a crash (crash recovery).
    num_engine_restarts: int = 0


def engine_state(snapshots: Collection[SchedulerStats]) -> SchedulerStats | None:
    """The engine's state from each core's latest snapshot (None: no step yet): requests
    running and waiting summed over the cores, KV cache usage their mean (the data
    parallel cores' caches are alike). A snapshot's per-step counters (prefix cache,
    preemptions, drafts, grammars) are not carried: loggers count them as they arrive."""
    if not snapshots:
        return None
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in snapshots),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in snapshots),
        kv_cache_usage=sum(s.kv_cache_usage for s in snapshots) / len(snapshots),
    )


@runtime_checkable
class StatLogger(Protocol):
    """Anything that wants the stats of every step (logging, Prometheus)."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None: ...


class LoggingStatLogger:
    """Logs throughput, queue lengths and cache use every ``interval_s`` seconds, and
    (when drafts were verified) the acceptance rate and mean acceptance length."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cache_queries = 0
        self._cache_hits = 0
        # Each core's latest snapshot, by engine index (data parallel: several).
        self._latest: dict[int, SchedulerStats] = {}
        self._spec = SpecDecodingSummary()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            engine = iteration_stats.engine_index if iteration_stats is not None else 0
            self._latest[engine] = scheduler_stats
            self._cache_queries += scheduler_stats.prefix_cache_queries
            self._cache_hits += scheduler_stats.prefix_cache_hits
            self._spec.add(scheduler_stats.spec_decoding_stats)
        now = time.monotonic()
        if now - self._last_log >= self.interval_s:
            self._log(now)

    def _log(self, now: float) -> None:
        elapsed = max(now - self._last_log, 1e-9)
        stats = engine_state(self._latest.values()) or SchedulerStats()
        hit_rate = self._cache_hits / self._cache_queries if self._cache_queries else 0.0
        spec = ""
        if self._spec.num_drafts:
            spec = ", " + self._spec.describe()
            self._spec.reset()
        logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, "
            "running %d, waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%%s",
            self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            hit_rate * 100,
            spec,
        )
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
        self._cache_queries = self._cache_hits = 0
