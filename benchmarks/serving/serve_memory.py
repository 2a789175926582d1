"""Resident memory of a real ``tokenloom serve``: peak and steady RSS of the front
end and the engine core process, on any model (the random-weight GGUFs of real
shapes from ``peers/make_gguf.py`` above all).

Starts the server (127.0.0.1 only) with ``--serve-args``, waits until it is
healthy, sends ``--requests`` completions (a ``--prompt-len``-token prompt of
fixed ids, ``--max-tokens`` greedy tokens), then reads each process's ``VmRSS``
(steady: after the requests) and ``VmHWM`` (its peak since it started, weights
loading included). The sum of the peaks bounds the tree's peak from above.

    G=.bench/gguf/llama-1b-random-Q4_K_M.gguf
    .venv/bin/python benchmarks/serving/serve_memory.py --serve-args "--model $G --max-model-len 2048 \\
        --kv-cache-memory-bytes 134217728"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import report, serving, tokenloom_serve_cmd  # noqa: E402  (stdlib-only helpers of the benchmarks)


def status_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB (10^6 bytes)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {key: int(fields[key].split()[0]) * 1024 / 1e6 for key in ("VmRSS", "VmHWM")}


def complete(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as resp:
        return dict(json.load(resp))


def measure(args: argparse.Namespace, base_url: str, server_pid: int) -> dict[str, Any]:
    prompt = [(i * 7919) % 20000 + 100 for i in range(args.prompt_len)]
    started = time.perf_counter()
    tokens = 0
    for _ in range(args.requests):
        tokens += complete(base_url, prompt, args.max_tokens)["usage"]["completion_tokens"]
    wall_s = time.perf_counter() - started
    processes: dict[str, dict[str, float]] = {}
    for proc in [psutil.Process(server_pid), *psutil.Process(server_pid).children(recursive=True)]:
        name = "front end" if proc.pid == server_pid else f"child {proc.pid}"
        if proc.pid != server_pid and "torch" in " ".join(m.path for m in proc.memory_maps()):
            name = "engine core"
        processes[name] = status_mb(proc.pid)
    return {
        "serve_args": args.serve_args,
        "processes": processes,
        "steady_rss_mb": round(sum(p["VmRSS"] for p in processes.values())),
        "sum_of_peaks_mb": round(sum(p["VmHWM"] for p in processes.values())),
        "completion_tokens": tokens,
        "requests_wall_s": round(wall_s, 1),
        "load": psutil.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-args", default="", help="`tokenloom serve` arguments")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on the start-up")
    ap.add_argument("--log", type=Path, default=ROOT / ".bench" / "serve-memory-server.log")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()

    base_url = f"http://127.0.0.1:{args.port}"
    serve_cmd = tokenloom_serve_cmd(args.port, args.serve_args)
    with serving(serve_cmd, base_url, args.log, ROOT, timeout_s=args.timeout_s) as server:
        result = measure(args, base_url, server.pid)
    report(result, "benchmarks/serving/serve_memory.py", args.json)


if __name__ == "__main__":
    main()
