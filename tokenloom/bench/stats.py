"""Per-request timings and the summary statistics a serving benchmark reports.

Definitions (the usual ones for LLM serving):
- TTFT: request sent -> first generated token received.
- ITL: gap between consecutive token arrivals of one request.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; requests with a
  single output token have no TPOT.
- E2E: request sent -> last token received.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Defined beside the engine's other statistics; named here too, where they began.
from tokenloom.metrics.percentiles import Summary, percentile  # noqa: F401


@dataclass
class RequestResult:
    """What the client saw for one request."""

    success: bool
    prompt_len: int
    output_len: int = 0  # tokens generated (server usage if reported, else stream events)
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0  # seconds since the benchmark began
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class BenchMetrics:
    """The aggregate results of one serving benchmark run."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> BenchMetrics:
    """Aggregate per-request results over a run that took ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    return BenchMetrics(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=n_out / duration_s,
        total_token_throughput=(n_in + n_out) / duration_s,
        ttft=Summary.of([r.ttft for r in ok]),
        tpot=Summary.of(tpots),
        itl=Summary.of([x for r in ok for x in r.itl]),
        e2e=Summary.of([r.e2e for r in ok]),
    )


def format_table(metrics: BenchMetrics, title: str = "Serving benchmark") -> str:
    """A plain-text table of the metrics; latencies in milliseconds."""
    m = metrics
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{m.completed}"),
        ("Failed requests", f"{m.failed}"),
        ("Duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", f"{m.total_input_tokens}"),
        ("Total output tokens", f"{m.total_output_tokens}"),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    for name, s in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2E", m.e2e)):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{getattr(s, stat) * 1000:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    bar = "=" * max(width + 12, len(title))
    lines = [bar, title.center(len(bar)), bar]
    lines += [f"{k:<{width}}{v:>12}" for k, v in rows]
    lines.append(bar)
    return "\n".join(lines)
