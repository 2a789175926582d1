"""Acceptance statistics and the per-request draft budget."""

import subprocess
import sys
from pathlib import Path

import msgspec

from tokenloom.metrics.spec_decode import SpecDecodingSummary
from tokenloom.outputs import SpecDecodingStats
from tokenloom.worker.spec_decode.draft_budget import PROBE_INTERVAL, DraftBudget


def test_stats_count_per_position_and_summarise() -> None:
    stats = SpecDecodingStats.new(num_spec_tokens=3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    stats.observe_draft(num_draft_tokens=1, num_accepted_tokens=0)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 7, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1]
    # It crosses the process boundary inside SchedulerStats.
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SpecDecodingStats)
    assert decoded == stats

    summary = SpecDecodingSummary()
    summary.add(stats)
    summary.add(None)
    summary.add(stats)
    assert summary.acceptance_rate == 5 / 7
    assert summary.mean_acceptance_length == 1 + 5 / 3
    assert summary.per_position_rates() == [2 / 3, 2 / 3, 1 / 3]
    assert "acceptance rate 71.4%" in summary.describe()
    assert "mean acceptance length 2.67" in summary.describe()


def test_metrics_module_does_not_load_torch() -> None:
    code = "import sys, tokenloom.metrics.spec_decode, tokenloom.outputs\nsys.exit(1 if 'torch' in sys.modules else 0)\n"
    repo = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo).returncode == 0


def test_batch_size_switch() -> None:
    budget = DraftBudget(4, disable_by_batch_size=8)
    assert budget.enabled(8) and not budget.enabled(9)
    assert DraftBudget(4, None).enabled(10_000)


def test_rarely_accepted_requests_fall_to_none_and_get_probed() -> None:
    budget = DraftBudget(4, None)
    assert budget.caps(["good", "bad"]).tolist() == [4, 4]
    for _ in range(5):
        good = budget.caps(["good"])[0]
        budget.observe("good", good, good)
    assert budget.caps(["good"]).tolist() == [4]
    # A request that never has a draft accepted soon drafts nothing ...
    steps = 0
    while (cap := budget.caps(["bad"])[0]) > 0:
        budget.observe("bad", cap, 0)
        steps += 1
    assert steps <= 3
    caps = [budget.caps(["bad"])[0] for _ in range(PROBE_INTERVAL - 2)]
    assert caps == [0] * (PROBE_INTERVAL - 2)
    # ... until a probe of one draft; accepted probes bring its budget back up.
    assert budget.caps(["bad"]).tolist() == [1]
    for _ in range(6):
        cap = max(budget.caps(["bad"])[0], 1)
        budget.observe("bad", cap, cap)
    assert budget.caps(["bad"]).tolist() == [4]


def test_partial_acceptance_gives_a_middle_budget_and_forget() -> None:
    budget = DraftBudget(8, None)
    for _ in range(20):
        budget.observe("r", 4, 2)  # a = 2/3: position i kept with (2/3)^i >= 1/4 up to i = 3
    assert budget.caps(["r"]).tolist() == [3]
    budget.forget("r")
    assert len(budget) == 0


def test_prometheus_counters_under_vllm_names() -> None:
    from prometheus_client import generate_latest

    from tokenloom.metrics.prometheus import PrometheusStatLogger
    from tokenloom.outputs import SchedulerStats

    stats = SpecDecodingStats.new(num_spec_tokens=2)
    stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(spec_decoding_stats=stats), None)
    logger.record(SchedulerStats(spec_decoding_stats=stats), None)
    text = generate_latest(logger.registry).decode()
    assert 'tokenloom:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'tokenloom:spec_decode_num_draft_tokens_total{model_name="m"} 4.0' in text
    assert 'tokenloom:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    assert (
        'tokenloom:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0'
        in text
    )


def test_periodic_log_line_has_acceptance(caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from tokenloom.metrics.stats import LoggingStatLogger
    from tokenloom.outputs import SchedulerStats

    stats = SpecDecodingStats.new(num_spec_tokens=2)
    stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    logger = LoggingStatLogger(interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="tokenloom.metrics.stats"):
        logger.record(SchedulerStats(spec_decoding_stats=stats), None)
    assert "acceptance rate 50.0%, mean acceptance length 2.00" in caplog.text
