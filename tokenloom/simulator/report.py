"""What a run comes to: throughput, TTFT and TPOT percentiles, preemptions, KV usage.

Latencies count the requests that completed in the trace (finished by a stop
or a length cap). TTFT runs from a request's arrival at the front end to the
end of the step that produced its first token; TPOT is the time per output
token after the first. Throughput is output tokens per second from the
first arrival to the last finish. KV usage is averaged over time (each step
weighs its duration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenloom.metrics.percentiles import Summary
from tokenloom.simulator.replay import RunResult


@dataclass(frozen=True)
class RunSummary:
    num_requests: int
    duration_s: float
    output_tokens: int
    output_throughput: float  # tokens/s
    request_throughput: float  # requests/s
    ttft: Summary
    tpot: Summary
    num_preemptions: int
    kv_cache_usage_mean: float
    kv_cache_usage_max: float
    num_steps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(run: RunResult) -> RunSummary:
    done = [
        r
        for r in run.requests
        if r.completed and r.finish is not None and r.first_token is not None
    ]
    output_tokens = sum(r.num_output_tokens for r in done)
    if done:
        duration = max(r.finish for r in done if r.finish is not None) - min(
            r.arrival for r in done
        )
    else:
        duration = 0.0
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    tpot = [
        (r.finish - r.first_token) / (r.num_output_tokens - 1)
        for r in done
        if r.num_output_tokens > 1 and r.finish is not None and r.first_token is not None
    ]
    busy = sum(s.duration for s in run.steps)
    kv_mean = sum(s.kv_cache_usage * s.duration for s in run.steps) / busy if busy else 0.0
    return RunSummary(
        num_requests=len(done),
        duration_s=duration,
        output_tokens=output_tokens,
        output_throughput=output_tokens / duration if duration > 0 else 0.0,
        request_throughput=len(done) / duration if duration > 0 else 0.0,
        ttft=Summary.of(ttft),
        tpot=Summary.of(tpot),
        num_preemptions=sum(r.num_preemptions for r in run.requests),
        kv_cache_usage_mean=kv_mean,
        kv_cache_usage_max=max((s.kv_cache_usage for s in run.steps), default=0.0),
        num_steps=len(run.steps),
    )


def format_table(columns: Sequence[tuple[str, RunSummary]]) -> str:
    """One column per run, one row per figure; latencies in milliseconds."""
    rows: list[tuple[str, list[str]]] = [
        ("requests", [f"{s.num_requests}" for _, s in columns]),
        ("duration (s)", [f"{s.duration_s:.2f}" for _, s in columns]),
        ("output tokens", [f"{s.output_tokens}" for _, s in columns]),
        ("output throughput (tok/s)", [f"{s.output_throughput:.2f}" for _, s in columns]),
        ("request throughput (req/s)", [f"{s.request_throughput:.3f}" for _, s in columns]),
    ]
    for name in ("ttft", "tpot"):
        for stat in ("median", "p90", "p99"):
            label = f"{name.upper()} {'p50' if stat == 'median' else stat} (ms)"
            rows.append(
                (label, [f"{getattr(getattr(s, name), stat) * 1e3:.1f}" for _, s in columns])
            )
    rows += [
        ("preemptions", [f"{s.num_preemptions}" for _, s in columns]),
        ("KV cache usage mean", [f"{s.kv_cache_usage_mean:.1%}" for _, s in columns]),
        ("KV cache usage max", [f"{s.kv_cache_usage_max:.1%}" for _, s in columns]),
        ("steps", [f"{s.num_steps}" for _, s in columns]),
    ]
    names = [name for name, _ in columns]
    first = max(len(label) for label, _ in rows) + 2
    width = max(12, *(len(n) + 2 for n in names))
    lines = [" " * first + "".join(f"{n:>{width}}" for n in names)]
    lines += [
        f"{label:<{first}}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows
    ]
    return "\n".join(lines)


def plot_runs(runs: Sequence[tuple[str, RunResult]], path: str | Path) -> Path:
    """Requests running and waiting, KV cache usage over time, and the TTFT distribution
    of each run, in one PNG (needs matplotlib: pip install tokenloom[bench])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    load, kv, cdf = axes
    for name, run in runs:
        steps = run.steps
        if steps:
            t0 = steps[0].start
            times = [s.start - t0 for s in steps]
            (line,) = load.plot(times, [s.num_running for s in steps], label=f"{name}: running")
            load.plot(
                times,
                [s.num_waiting for s in steps],
                color=line.get_color(),
                linestyle="--",
                label=f"{name}: waiting",
            )
            kv.plot(times, [100 * s.kv_cache_usage for s in steps], label=name)
        ttft = sorted(
            r.first_token - r.arrival
            for r in run.requests
            if r.completed and r.first_token is not None
        )
        if ttft:
            cdf.plot(
                [t * 1e3 for t in ttft], [(i + 1) / len(ttft) for i in range(len(ttft))], label=name
            )
    load.set(title="requests", xlabel="seconds")
    kv.set(title="KV cache usage (%)", xlabel="seconds", ylim=(0, 100))
    cdf.set(title="TTFT distribution", xlabel="ms", ylabel="share of requests")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
