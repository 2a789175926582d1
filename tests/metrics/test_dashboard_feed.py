"""DashboardFeed: the dashboard's data, built from the stats the engine reports."""

from __future__ import annotations

from tokenloom.metrics.dashboard import MAX_STEPS, MAX_TIMELINES, DashboardFeed, percentiles
from tokenloom.metrics.stats import FinishedRequestStats, IterationStats, RequestTimeline
from tokenloom.outputs import SchedulerStats, StepStats


def step(
    index: int, prefill: int = 0, decode: int = 0, preempted: list[str] | None = None
) -> StepStats:
    return StepStats(
        index=index,
        timestamp=100.0 + index,
        duration_s=0.02,
        num_reqs=decode + (1 if prefill else 0),
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_draft_tokens=0,
        preempted_req_ids=preempted or [],
    )


def finished(req_id: str, tokens: int, decode_time: float) -> FinishedRequestStats:
    timeline = RequestTimeline(
        req_id, 10.0, 10.1, 10.3, 10.3 + decode_time, [10.2], 20, tokens, 16, "length"
    )
    return FinishedRequestStats(
        "length", num_generation_tokens=tokens, decode_time=decode_time, timeline=timeline
    )


def test_totals_gauges_steps_and_latencies() -> None:
    feed = DashboardFeed("m")
    stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_preemptions=1,
        step=step(0, prefill=64, decode=2, preempted=["a"]),
        kv_block_map=bytes([0, 1, 2, 2, 3, 0]),
    )
    iteration = IterationStats(
        num_prompt_tokens=64,
        num_generation_tokens=5,
        time_to_first_tokens_iter=[0.1, 0.3],
        finished_requests=[finished("a", 11, 1.0), finished("b", 1, 0.0)],
    )
    feed.record(stats, iteration)
    feed.record(SchedulerStats(num_running_reqs=2, step=step(1, decode=2)), None)
    snap = feed.snapshot()

    assert (snap["running"], snap["waiting"]) == (2, 0)  # the latest gauges
    assert snap["totals"] == {
        "finished_requests": 2,
        "prompt_tokens": 64,
        "generation_tokens": 5,
        "preemptions": 1,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "steps": 2,
    }
    assert snap["ttft"] == {"p50": 0.2, "p90": 0.28, "p99": 0.298}
    # One request with more than one token: (1.0 s) / (11 - 1) tokens.
    assert snap["tpot"]["p50"] == 0.1
    [engine] = snap["engines"]
    assert engine["steps"]["prefill"] == [64, 0]
    assert engine["steps"]["decode"] == [2, 2]
    assert engine["steps"]["preempted"] == [1, 0]
    assert engine["block_map"] == "012230"
    assert engine["block_counts"] == {"free": 2, "cached": 1, "used": 2, "shared": 1}
    assert [r["request_id"] for r in engine["requests"]] == ["b", "a"]  # newest first
    assert engine["requests"][1]["preemption_times"] == [10.2]


def test_series_sample_rates_over_the_interval() -> None:
    feed = DashboardFeed("m")
    feed.tick(now=1000.0)
    feed.record(
        SchedulerStats(
            num_running_reqs=4, kv_cache_usage=0.5, prefix_cache_queries=10, prefix_cache_hits=5
        ),
        IterationStats(num_prompt_tokens=200, num_generation_tokens=30),
    )
    feed.tick(now=1000.5)  # too soon: no sample
    feed.tick(now=1002.0)
    series = feed.snapshot()["engines"][0]["series"]
    assert series["t"] == [1000.0, 1002.0]
    assert series["running"] == [0, 4]
    assert series["prefix_cache_hit_rate"] == [None, 0.5]  # no lookups yet: no rate
    assert series["prompt_tps"][1] == 100.0 and series["generation_tps"][1] == 15.0


def test_windows_are_bounded_and_timelines_merge_by_request() -> None:
    feed = DashboardFeed("m")
    for i in range(MAX_STEPS + 10):
        feed.record(SchedulerStats(step=step(i, decode=1)), None)
    started = RequestTimeline("x", 1.0, 1.1, 1.2)
    feed.record(None, IterationStats(started_requests=[started]))
    feed.record(None, IterationStats(finished_requests=[finished("x", 3, 0.5)]))
    for i in range(MAX_TIMELINES):
        feed.record(None, IterationStats(started_requests=[RequestTimeline(f"r{i}", 2.0)]))
    engine = feed.snapshot()["engines"][0]
    assert len(engine["steps"]["index"]) == MAX_STEPS
    assert engine["steps"]["index"][-1] == MAX_STEPS + 9
    ids = [r["request_id"] for r in engine["requests"]]
    assert len(ids) == MAX_TIMELINES and "x" not in ids  # the oldest went first


def test_one_panel_per_engine_core_and_totals_over_all() -> None:
    feed = DashboardFeed("m", num_engines=2)
    feed.record(
        SchedulerStats(num_running_reqs=1), IterationStats(engine_index=0, num_generation_tokens=3)
    )
    feed.record(
        SchedulerStats(num_running_reqs=5), IterationStats(engine_index=1, num_generation_tokens=4)
    )
    snap = feed.snapshot()
    assert [e["running"] for e in snap["engines"]] == [1, 5]
    assert snap["running"] == 6
    assert snap["totals"]["generation_tokens"] == 7


def test_percentiles_of_nothing_are_none() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles([2.0]) == {"p50": 2.0, "p90": 2.0, "p99": 2.0}
