"""Latency-throughput curve of `tokenloom serve` under `tokenloom bench serve`.

Starts one server, then runs the load generator against it at each
``--concurrencies`` level (fixed max concurrency, all requests queued at once)
on the same seeded random workload shape, and writes a markdown table and a
plot (output tokens/s against median TPOT, TTFT and end-to-end latency, one
point per concurrency). Each level's full JSON results stay in ``--workdir``.

    .venv/bin/python benchmarks/serving/serve_curve.py --concurrencies 1 8 32 128
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import serving  # noqa: E402  (stdlib-only helpers of the benchmarks)


def run_level(args: argparse.Namespace, base_url: str, concurrency: int) -> dict[str, Any]:
    """One bench-serve run; returns its metrics dict."""
    out_dir = args.workdir / f"c{concurrency}"
    num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
    cmd = [
        sys.executable, "-m", "tokenloom.entrypoints.cli", "bench", "serve",
        "--base-url", base_url,
        "--dataset-name", "random",
        "--num-prompts", str(num_prompts),
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio),
        "--max-concurrency", str(concurrency),
        "--ignore-eos",
        "--seed", str(args.seed),
        "--result-dir", str(out_dir),
        "--no-plots",
        "--disable-tqdm",
    ]  # fmt: skip
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    newest = max(out_dir.glob("serve-*.json"), key=lambda p: p.stat().st_mtime)
    metrics = json.loads(newest.read_text())["metrics"]
    metrics["concurrency"] = concurrency
    metrics["num_prompts"] = num_prompts
    return metrics


def write_table(rows: list[dict[str, Any]], command: str, args: argparse.Namespace) -> str:
    lines = [
        "Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        f"Random workload: prompts {args.input_len} tokens and outputs {args.output_len} "
        f"tokens (each +/- {args.range_ratio:.0%}, seed {args.seed}), `ignore_eos`, "
        f"{args.prompts_per_slot} requests per concurrency slot (at least {args.min_prompts}).",
        "",
        "| concurrency | requests | output tok/s | total tok/s | TTFT median (s) | TTFT p90 (s) "
        "| TPOT median (ms) | TPOT p90 (ms) | ITL p99 (ms) | E2E median (s) | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in rows:
        lines.append(
            f"| {m['concurrency']} | {m['num_prompts']} | {m['output_throughput']:.1f} "
            f"| {m['total_token_throughput']:.1f} | {m['ttft']['median']:.2f} "
            f"| {m['ttft']['p90']:.2f} | {m['tpot']['median'] * 1e3:.1f} "
            f"| {m['tpot']['p90'] * 1e3:.1f} | {m['itl']['p99'] * 1e3:.1f} "
            f"| {m['e2e']['median']:.2f} | {m['failed']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tput = [m["output_throughput"] for m in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [
        ("median TPOT (ms)", [m["tpot"]["median"] * 1e3 for m in rows]),
        ("median TTFT (s)", [m["ttft"]["median"] for m in rows]),
        ("median end-to-end latency (s)", [m["e2e"]["median"] for m in rows]),
    ]
    for ax, (label, values) in zip(axes, panels, strict=True):
        ax.plot(tput, values, marker="o")
        for m, x, y in zip(rows, tput, values, strict=True):
            ax.annotate(f"c={m['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("tokenloom serve: latency vs throughput by max concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--prompts-per-slot", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--serve-args", default="", help="extra `tokenloom serve` arguments")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "serve-curve")
    ap.add_argument("--out-md", type=Path, default=ROOT / ".bench" / "serve_curve.md")
    ap.add_argument("--out-png", type=Path, default=ROOT / ".bench" / "serve_curve.png")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/serving/serve_curve.py " + shlex.join(sys.argv[1:])

    base_url = f"http://127.0.0.1:{args.port}"
    serve_cmd = [
        sys.executable, "-m", "tokenloom.entrypoints.cli", "serve",
        "--port", str(args.port), *shlex.split(args.serve_args),
    ]  # fmt: skip
    with serving(serve_cmd, base_url, args.workdir / "server.log", ROOT):
        rows = [run_level(args, base_url, c) for c in args.concurrencies]
    (args.workdir / "curve.json").write_text(json.dumps(rows, indent=2))
    args.out_md.write_text(write_table(rows, command, args))
    plot(rows, args.out_png)
    print(args.out_md.read_text())
    print(f"wrote {args.out_md} and {args.out_png}")


if __name__ == "__main__":
    main()
