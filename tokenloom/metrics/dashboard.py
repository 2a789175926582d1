"""The live dashboard's data: what each engine core did, kept in bounded windows.

``DashboardFeed`` is a stat logger, fed the scheduler snapshot and the front
end's iteration stats of every step the way the Prometheus logger is (it
never asks the engine anything). Per engine core it keeps the latest gauges,
the last steps' batch composition (``StepStats``), the latest KV block map,
time series sampled once a second (requests running and waiting, KV cache
usage, prefix-cache hit rate, throughput), running totals, the recent
requests' timelines and the latencies of the recently finished ones.
``snapshot()`` turns it into the JSON the dashboard page draws; with data
parallelism there is one panel per core.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenloom.metrics.percentiles import percentile
from tokenloom.metrics.stats import IterationStats, RequestTimeline
from tokenloom.outputs import (
    KV_BLOCK_CACHED,
    KV_BLOCK_FREE,
    KV_BLOCK_SHARED,
    KV_BLOCK_USED,
    SchedulerStats,
    StepStats,
)

# Windows: steps drawn, seconds of history, requests on the timeline, latencies ranked.
MAX_STEPS = 300
MAX_SAMPLES = 300
MAX_TIMELINES = 40
MAX_LATENCIES = 1000
SAMPLE_INTERVAL_S = 1.0
PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` (None when there are none)."""
    return {f"p{p}": percentile(values, p) if values else None for p in PERCENTILES}


@dataclass
class _Totals:
    finished_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0

    def add(self, other: _Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Panel:
    """One engine core's view."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    totals: _Totals = field(default_factory=_Totals)
    steps: deque[StepStats] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))
    block_map: bytes | None = None
    samples: deque[tuple[float, ...]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    # Totals at the previous sample, for rates over the interval.
    sampled_at: float = 0.0
    sampled_totals: _Totals = field(default_factory=_Totals)
    timelines: dict[str, RequestTimeline] = field(default_factory=dict)
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCIES))
    tpot: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCIES))

    def sample(self, now: float) -> None:
        before, after = self.sampled_totals, self.totals
        elapsed = now - self.sampled_at if self.sampled_at else 0.0
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        prompt = after.prompt_tokens - before.prompt_tokens
        generation = after.generation_tokens - before.generation_tokens
        self.samples.append(
            (
                now,
                self.running,
                self.waiting,
                self.kv_cache_usage,
                hits / queries if queries else float("nan"),
                prompt / elapsed if elapsed else 0.0,
                generation / elapsed if elapsed else 0.0,
            )
        )
        self.sampled_at = now
        self.sampled_totals = _Totals(**vars(after))

    def add_timeline(self, timeline: RequestTimeline) -> None:
        timelines = self.timelines
        timelines.pop(timeline.request_id, None)  # re-inserted last: the newest event
        timelines[timeline.request_id] = timeline
        while len(timelines) > MAX_TIMELINES:
            del timelines[next(iter(timelines))]


_SERIES = (
    "t",
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_cache_hit_rate",
    "prompt_tps",
    "generation_tps",
)


class DashboardFeed:
    """Keeps the dashboard's data (see the module doc); a ``StatLogger``."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.model_name = model_name
        self.num_engines = num_engines
        self.started = time.time()
        self._panels = [_Panel() for _ in range(num_engines)]

    def _panel(self, engine_index: int) -> _Panel:
        while engine_index >= len(self._panels):  # defensive: a core beyond num_engines
            self._panels.append(_Panel())
        return self._panels[engine_index]

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        engine = iteration_stats.engine_index if iteration_stats is not None else 0
        panel = self._panel(engine)
        totals = panel.totals
        if scheduler_stats is not None:
            panel.running = scheduler_stats.num_running_reqs
            panel.waiting = scheduler_stats.num_waiting_reqs
            panel.kv_cache_usage = scheduler_stats.kv_cache_usage
            totals.preemptions += scheduler_stats.num_preemptions
            totals.prefix_cache_queries += scheduler_stats.prefix_cache_queries
            totals.prefix_cache_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.step is not None:
                panel.steps.append(scheduler_stats.step)
                totals.steps += 1
            if scheduler_stats.kv_block_map is not None:
                panel.block_map = scheduler_stats.kv_block_map
        if iteration_stats is None:
            return
        totals.prompt_tokens += iteration_stats.num_prompt_tokens
        totals.generation_tokens += iteration_stats.num_generation_tokens
        panel.ttft.extend(iteration_stats.time_to_first_tokens_iter)
        for timeline in iteration_stats.started_requests:
            panel.add_timeline(timeline)
        for finished in iteration_stats.finished_requests:
            totals.finished_requests += 1
            if finished.num_generation_tokens > 1:
                panel.tpot.append(finished.decode_time / (finished.num_generation_tokens - 1))
            if finished.timeline is not None:
                panel.add_timeline(finished.timeline)

    def tick(self, now: float | None = None) -> None:
        """Take the once-a-second samples that are due (the event stream calls this)."""
        now = time.time() if now is None else now
        for panel in self._panels:
            if now - panel.sampled_at >= SAMPLE_INTERVAL_S * 0.99:
                panel.sample(now)

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as JSON-ready data."""
        panels = [self._panel_json(i, p) for i, p in enumerate(self._panels)]
        totals = _Totals()
        ttft: list[float] = []
        tpot: list[float] = []
        for panel in self._panels:
            totals.add(panel.totals)
            ttft.extend(panel.ttft)
            tpot.extend(panel.tpot)
        running = sum(p.running for p in self._panels)
        waiting = sum(p.waiting for p in self._panels)
        return {
            "time": time.time(),
            "started": self.started,
            "model": self.model_name,
            "num_engines": self.num_engines,
            "running": running,
            "waiting": waiting,
            "totals": vars(totals),
            "ttft": percentiles(ttft),
            "tpot": percentiles(tpot),
            "engines": panels,
        }

    @staticmethod
    def _panel_json(index: int, panel: _Panel) -> dict[str, Any]:
        columns = list(zip(*panel.samples, strict=True)) if panel.samples else [()] * len(_SERIES)
        series = {
            name: [None if v != v else v for v in column]  # NaN (no lookups) -> null
            for name, column in zip(_SERIES, columns, strict=True)
        }
        steps = panel.steps
        block_map = panel.block_map
        return {
            "engine": index,
            "running": panel.running,
            "waiting": panel.waiting,
            "kv_cache_usage": panel.kv_cache_usage,
            "totals": vars(panel.totals),
            "ttft": percentiles(panel.ttft),
            "tpot": percentiles(panel.tpot),
            "series": series,
            "steps": {
                "index": [s.index for s in steps],
                "t": [s.timestamp for s in steps],
                "duration_ms": [s.duration_s * 1e3 for s in steps],
                "requests": [s.num_reqs for s in steps],
                "prefill": [s.num_prefill_tokens for s in steps],
                "decode": [s.num_decode_tokens for s in steps],
                "draft": [s.num_draft_tokens for s in steps],
                "preempted": [len(s.preempted_req_ids) for s in steps],
            },
            "block_map": None if block_map is None else block_map.hex()[1::2],
            "block_counts": None
            if block_map is None
            else {
                "free": block_map.count(KV_BLOCK_FREE),
                "cached": block_map.count(KV_BLOCK_CACHED),
                "used": block_map.count(KV_BLOCK_USED),
                "shared": block_map.count(KV_BLOCK_SHARED),
            },
            "requests": [vars(t) for t in reversed(panel.timelines.values())],
        }
