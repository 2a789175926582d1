"""Percentiles and latency summaries, the same for every report: the serving benchmark,
the simulator and the dashboard."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), ``q`` in [0, 100]."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Mean, median, p90 and p99 of one latency metric (seconds), plus the count."""

    mean: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        n = len(values)
        mean = sum(values) / n if n else math.nan
        return cls(mean, percentile(values, 50), percentile(values, 90), percentile(values, 99), n)
