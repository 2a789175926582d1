"""How well ``tokenloom simulate`` predicts real runs of the main workload.

Runs ``tokenloom serve`` with ``--record-trace`` under a base configuration
and three others (another ``--max-num-seqs``, another
``--max-num-batched-tokens``, another arrival rate), loading each with
``tokenloom bench serve`` on the main workload (the one compare_peers.py and
``tokenloom bench`` use: prompts log-uniform in 32-512 tokens, outputs
log-uniform in 16-256, ``ignore_eos``), Poisson arrivals. Then it predicts
each run from the base run's trace alone (``tokenloom simulate`` with the
run's settings) and compares the predictions with what the load generator
measured: output throughput and TTFT p50.

The runs alternate (base, A, B, C, then C, B, A, base for ``--repeats 2``) so
that a busy machine weighs on all of them alike; each figure is the median
over the repeats, and the machine's load average is kept beside each run.

    .venv/bin/python benchmarks/serving/simulator_accuracy.py --num-prompts 16 --rate 0.25 --other-rate 0.5 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import serving  # noqa: E402  (stdlib-only helpers of the benchmarks)

CLI = [sys.executable, "-m", "tokenloom.entrypoints.cli"]


@dataclass(frozen=True)
class Config:
    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    request_rate: float


def run_once(args: argparse.Namespace, config: Config, repeat: int) -> dict[str, Any]:
    """Serve ``config`` recording a trace, load it with the main workload; the results."""
    out = args.workdir / f"{config.name}-{repeat}"
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    base_url = f"http://127.0.0.1:{args.port}"
    serve = [
        *CLI, "serve", "--port", str(args.port),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--record-trace", str(trace), *shlex.split(args.serve_args),
    ]  # fmt: skip
    bench = [
        *CLI, "bench", "serve", "--base-url", base_url,
        "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--input-len-dist", "log-uniform", "--min-input-len", "32", "--max-input-len", "512",
        "--output-len-dist", "log-uniform", "--min-output-len", "16", "--max-output-len", "256",
        "--ignore-eos", "--request-rate", str(config.request_rate), "--seed", str(args.seed),
        "--result-dir", str(out), "--no-plots", "--disable-tqdm",
    ]  # fmt: skip
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with serving(serve, base_url, out / "server.log", ROOT):
        print("$", shlex.join(bench), flush=True)
        subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    result = json.loads(max(out.glob("serve-*.json"), key=lambda p: p.stat().st_mtime).read_text())
    metrics = result["metrics"]
    return {
        "config": config.name,
        "repeat": repeat,
        "trace": str(trace),
        "output_throughput": metrics["output_throughput"],
        "ttft_p50": metrics["ttft"]["median"],
        "wall_s": time.monotonic() - started,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def simulate(trace: str, config: Config, base: Config, out: Path) -> dict[str, Any]:
    """``tokenloom simulate`` of ``trace`` (recorded under ``base``) with ``config``'s settings."""
    cmd = [
        *CLI, "simulate", "--trace", trace, "--no-draw", "--json", str(out),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--rate-scale", repr(config.request_rate / base.request_rate),
    ]  # fmt: skip
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def pct(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.25, help="the base run's requests/s")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--other-max-num-seqs", type=int, default=4)
    ap.add_argument("--other-max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--other-rate", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8137)
    ap.add_argument("--serve-args", default="", help="extra `tokenloom serve` arguments")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "simulator-accuracy")
    ap.add_argument("--out-md", type=Path, default=ROOT / ".bench" / "simulator_accuracy.md")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/serving/simulator_accuracy.py " + shlex.join(sys.argv[1:])

    seqs, tokens = args.max_num_seqs, args.max_num_batched_tokens
    base = Config("base", seqs, tokens, args.rate)
    configs = [
        base,
        Config("max-num-seqs", args.other_max_num_seqs, tokens, args.rate),
        Config("max-num-batched-tokens", seqs, args.other_max_num_batched_tokens, args.rate),
        Config("arrival-rate", seqs, tokens, args.other_rate),
    ]
    order = [c for r in range(args.repeats) for c in (configs if r % 2 == 0 else configs[::-1])]
    runs: list[dict[str, Any]] = []
    for i, config in enumerate(order):
        repeat = sum(1 for c in order[:i] if c is config)
        runs.append(run_once(args, config, repeat))
        print(json.dumps(runs[-1]), flush=True)
    (args.workdir / "runs.json").write_text(json.dumps(runs, indent=2))

    base_traces = [r["trace"] for r in runs if r["config"] == "base"]
    rows = []
    for config in configs:
        measured = [r for r in runs if r["config"] == config.name]
        predictions = [
            simulate(t, config, base, args.workdir / f"predict-{config.name}-{i}.json")
            for i, t in enumerate(base_traces)
        ]
        rows.append(
            {
                "config": config,
                "throughput": statistics.median(r["output_throughput"] for r in measured),
                "ttft": statistics.median(r["ttft_p50"] for r in measured),
                "predicted_throughput": statistics.median(
                    p["simulated"]["output_throughput"] for p in predictions
                ),
                "predicted_ttft": statistics.median(
                    p["simulated"]["ttft"]["median"] for p in predictions
                ),
                "load": statistics.mean(r["load_before"] for r in measured),
            }
        )
    lines = [
        "Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        f"{args.num_prompts} requests of the main workload per run, Poisson arrivals, seed "
        f"{args.seed}; {args.repeats} runs per configuration, alternating; medians. "
        f"Predictions come from the base run's trace{'s' if len(base_traces) > 1 else ''} only.",
        "",
        "| run | max-num-seqs | max-num-batched-tokens | rate (req/s) | output tok/s measured "
        "| predicted | error | TTFT p50 measured (ms) | predicted | error | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c = row["config"]
        lines.append(
            f"| {c.name} | {c.max_num_seqs} | {c.max_num_batched_tokens} | {c.request_rate:g} "
            f"| {row['throughput']:.1f} | {row['predicted_throughput']:.1f} "
            f"| {pct(row['predicted_throughput'], row['throughput'])} "
            f"| {row['ttft'] * 1e3:.0f} | {row['predicted_ttft'] * 1e3:.0f} "
            f"| {pct(row['predicted_ttft'], row['ttft'])} | {row['load']:.1f} |"
        )
    args.out_md.write_text("\n".join(lines) + "\n")
    print(args.out_md.read_text())


if __name__ == "__main__":
    main()
