"""Latency statistics against values computed by hand."""

from __future__ import annotations

import math

import pytest

from tokenloom.bench.stats import RequestResult, Summary, compute_metrics, format_table, percentile


def test_percentile_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    # p90: position 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q"):
        percentile(xs, 101)


def test_summary():
    s = Summary.of([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s.mean == pytest.approx(4.0)
    assert s.median == 3.0
    assert s.p90 == pytest.approx(7.6)  # position 3.6 -> 4 + 0.6 * 6
    assert s.count == 5


def test_compute_metrics_by_hand():
    a = RequestResult(
        True, prompt_len=10, output_len=5, ttft=0.2, e2e=1.0, itl=[0.2, 0.2, 0.2, 0.2]
    )
    b = RequestResult(True, prompt_len=20, output_len=3, ttft=0.4, e2e=0.8, itl=[0.1, 0.3])
    c = RequestResult(True, prompt_len=7, output_len=1, ttft=0.3, e2e=0.3)
    bad = RequestResult(False, prompt_len=99, error="boom")
    m = compute_metrics([a, b, c, bad], duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 37 and m.total_output_tokens == 9
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(23.0)
    assert m.ttft.mean == pytest.approx(0.3)
    assert m.ttft.median == pytest.approx(0.3)
    # TPOT: a = 0.8 / 4 = 0.2, b = 0.4 / 2 = 0.2; c has a single token -> no TPOT.
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(0.2)
    assert m.itl.count == 6
    assert m.itl.mean == pytest.approx(1.2 / 6)
    assert m.itl.median == pytest.approx(0.2)
    assert m.e2e.mean == pytest.approx(0.7)
    assert m.e2e.p99 == pytest.approx(0.8 + 0.98 * 0.2)
    table = format_table(m)
    assert "Output token throughput (tok/s)" in table and "4.50" in table
    assert "Median TTFT (ms)" in table and "300.00" in table


def test_compute_metrics_rejects_zero_duration():
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], 0.0)
