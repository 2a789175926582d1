"""LoggingStatLogger sums what it is given and logs it on its interval."""

from __future__ import annotations

import logging

import pytest

from tokenloom.metrics.stats import IterationStats, LoggingStatLogger, StatLogger
from tokenloom.outputs import SchedulerStats


def test_logs_throughput_queue_and_cache(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger(interval_s=3600)
    assert isinstance(stat_logger, StatLogger)
    caplog.set_level(logging.INFO, logger="tokenloom.metrics.stats")
    stat_logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=100,
            prefix_cache_hits=25,
        ),
        IterationStats(num_prompt_tokens=40, num_generation_tokens=3),
    )
    assert caplog.records == []  # the interval has not passed
    stat_logger.record(None, IterationStats(num_generation_tokens=7))
    stat_logger.interval_s = 0.0
    stat_logger.record(None, None)
    (record,) = caplog.records
    message = record.getMessage()
    assert "running 3, waiting 2" in message
    assert "KV cache usage 50.0%" in message and "prefix cache hit rate 25.0%" in message
    assert "generation throughput" in message
    # Counters restart after each log line.
    caplog.clear()
    stat_logger.record(None, None)
    assert "prefix cache hit rate 0.0%" in caplog.records[0].getMessage()


def test_logs_the_state_of_all_data_parallel_cores(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger(interval_s=3600)
    caplog.set_level(logging.INFO, logger="tokenloom.metrics.stats")
    stat_logger.record(SchedulerStats(4, 1, 0.5), IterationStats(engine_index=0))
    stat_logger.record(SchedulerStats(2, 0, 0.1), IterationStats(engine_index=1))
    stat_logger.record(SchedulerStats(3, 2, 0.3), IterationStats(engine_index=1))  # core 1 again
    stat_logger.interval_s = 0.0
    stat_logger.record(None, None)
    (record,) = caplog.records
    assert "running 7, waiting 3, KV cache usage 40.0%" in record.getMessage()
