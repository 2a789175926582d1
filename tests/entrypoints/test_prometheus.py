"""PrometheusStatLogger: stats in, vLLM-named metrics out (no model)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenloom.metrics.prometheus import PrometheusStatLogger, token_count_buckets
from tokenloom.metrics.stats import FinishedRequestStats, IterationStats, StatLogger
from tokenloom.outputs import KVTransferStats, SchedulerStats


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    key = (name, frozenset({"model_name": "m", **labels}.items()))
    return samples(registry)[key]


def test_logger_satisfies_the_stat_logger_protocol() -> None:
    assert isinstance(PrometheusStatLogger("m", CollectorRegistry()), StatLogger)


def test_scheduler_stats_set_gauges_and_add_deltas() -> None:
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry)
    assert value(registry, "tokenloom:request_success_total", finished_reason="stop") == 0
    for _ in range(2):
        stat_logger.record(
            SchedulerStats(
                num_running_reqs=3,
                num_waiting_reqs=1,
                kv_cache_usage=0.25,
                prefix_cache_queries=10,
                prefix_cache_hits=4,
                num_preemptions=1,
            ),
            None,
        )
    assert value(registry, "tokenloom:num_requests_running") == 3
    assert value(registry, "tokenloom:num_requests_waiting") == 1
    assert value(registry, "tokenloom:kv_cache_usage_perc") == 0.25
    assert value(registry, "tokenloom:prefix_cache_queries_total") == 20
    assert value(registry, "tokenloom:prefix_cache_hits_total") == 8
    assert value(registry, "tokenloom:num_preemptions_total") == 2
    stat_logger.record(SchedulerStats(), None)
    assert value(registry, "tokenloom:num_requests_running") == 0


def test_iteration_stats_feed_counters_and_histograms() -> None:
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry)
    finished = FinishedRequestStats(
        finish_reason="length",
        e2e_latency=1.5,
        queued_time=0.2,
        prefill_time=0.3,
        decode_time=1.0,
        num_prompt_tokens=12,
        num_generation_tokens=4,
    )
    stats = IterationStats(
        num_prompt_tokens=12,
        num_generation_tokens=4,
        time_to_first_tokens_iter=[0.3],
        inter_token_latencies_iter=[0.01, 0.02, 0.03],
        finished_requests=[finished],
    )
    stat_logger.record(None, stats)
    assert value(registry, "tokenloom:prompt_tokens_total") == 12
    assert value(registry, "tokenloom:generation_tokens_total") == 4
    assert value(registry, "tokenloom:request_success_total", finished_reason="length") == 1
    assert value(registry, "tokenloom:request_success_total", finished_reason="stop") == 0
    assert value(registry, "tokenloom:time_to_first_token_seconds_count") == 1
    assert value(registry, "tokenloom:inter_token_latency_seconds_count") == 3
    assert abs(value(registry, "tokenloom:inter_token_latency_seconds_sum") - 0.06) < 1e-9
    assert value(registry, "tokenloom:e2e_request_latency_seconds_sum") == 1.5
    assert value(registry, "tokenloom:request_queue_time_seconds_sum") == 0.2
    assert value(registry, "tokenloom:request_prompt_tokens_sum") == 12
    assert value(registry, "tokenloom:request_generation_tokens_sum") == 4
    # 4 generated tokens fall in the le=5 bucket but not le=2.
    assert value(registry, "tokenloom:request_generation_tokens_bucket", le="5.0") == 1
    assert value(registry, "tokenloom:request_generation_tokens_bucket", le="2.0") == 0


def test_two_loggers_do_not_share_a_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    PrometheusStatLogger("m", first).record(SchedulerStats(num_running_reqs=5), None)
    PrometheusStatLogger("m", second)
    assert value(first, "tokenloom:num_requests_running") == 5
    assert value(second, "tokenloom:num_requests_running") == 0


def test_token_count_buckets_reach_the_context_length() -> None:
    assert token_count_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_count_buckets(2048)[-1] == 5000


def test_structured_output_metrics() -> None:
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry)
    assert value(registry, "tokenloom:structured_output_requests_total") == 0
    # 64 requests for one schema: one compile, 63 reuses.
    stat_logger.record(
        SchedulerStats(
            num_structured_requests=64, grammar_compile_times=[0.02], grammar_cache_hits=63
        ),
        None,
    )
    stat_logger.record(SchedulerStats(num_structured_requests=1, grammar_cache_hits=1), None)
    assert value(registry, "tokenloom:structured_output_requests_total") == 65
    assert value(registry, "tokenloom:structured_output_grammar_cache_hits_total") == 64
    assert value(registry, "tokenloom:structured_output_compile_time_seconds_count") == 1
    assert value(registry, "tokenloom:structured_output_compile_time_seconds_sum") == 0.02


def test_kv_connector_metrics() -> None:
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry)
    for _ in range(2):
        kv = KVTransferStats(
            num_queried_tokens=64,
            num_hit_tokens=48,
            num_recomputed_tokens=16,
            num_bytes={"load": 1000, "save": 3000},
            seconds={"load": [0.002, 0.004]},
            errors={"corrupt": 1},
            tier_bytes=5000,
        )
        stat_logger.record(SchedulerStats(kv_transfer_stats=kv), None)
    assert value(registry, "tokenloom:external_prefix_cache_queries_total") == 128
    assert value(registry, "tokenloom:external_prefix_cache_hits_total") == 96
    assert value(registry, "tokenloom:kv_transfer_recomputed_tokens_total") == 32
    assert value(registry, "tokenloom:kv_transfer_bytes_total", op="load") == 2000
    assert value(registry, "tokenloom:kv_transfer_bytes_total", op="save") == 6000
    assert value(registry, "tokenloom:kv_transfer_seconds_count", op="load") == 4
    assert value(registry, "tokenloom:kv_transfer_errors_total", reason="corrupt") == 2
    assert value(registry, "tokenloom:kv_offload_disk_bytes") == 5000
