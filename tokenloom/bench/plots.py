"""PNG plots of benchmark results (matplotlib, headless Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenloom.bench.stats import RequestResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve_results(
    results: Sequence[RequestResult], out_dir: str | Path, prefix: str
) -> list[Path]:
    """Latency histograms and a token-arrival timeline; returns the files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.success]
    written: list[Path] = []

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("TTFT (ms)", [r.ttft * 1000 for r in ok]),
        ("TPOT (ms)", [t * 1000 for t in (r.tpot for r in ok) if t is not None]),
        ("ITL (ms)", [x * 1000 for r in ok for x in r.itl]),
        ("E2E latency (s)", [r.e2e for r in ok]),
    ]
    for ax, (label, values) in zip(axes.flat, panels, strict=True):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.suptitle(f"{prefix}: latency distributions ({len(ok)} requests)")
    fig.tight_layout()
    path = out / f"{prefix}_latency.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(10, 4))
    for i, r in enumerate(ok):
        ax.plot([r.start_time, r.start_time + r.e2e], [i, i], color="tab:gray", lw=1)
        ax.plot([r.start_time + r.ttft], [i], marker="|", color="tab:red")
    ax.set_xlabel("seconds since start (red: first token)")
    ax.set_ylabel("request")
    fig.tight_layout()
    path = out / f"{prefix}_timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def plot_throughput_bars(
    rows: Sequence[tuple[str, str, float]], path: str | Path, ylabel: str = "output tokens/s"
) -> Path:
    """Grouped bars: one group per workload, one bar per engine. rows: (engine, workload, value)."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(w for _, w, _ in rows))
    engines = list(dict.fromkeys(e for e, _, _ in rows))
    values = {(e, w): v for e, w, v in rows}
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(workloads) + 2), 4.5))
    for i, eng in enumerate(engines):
        xs = [j + i * width for j in range(len(workloads))]
        ys = [values.get((eng, w), 0.0) for w in workloads]
        bars = ax.bar(xs, ys, width=width, label=eng)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
