"""Does one huge prompt freeze the server? /health latency while a ~10 MB prompt is tokenized.

Starts ``tokenloom serve`` on the default model (127.0.0.1 only), opens
``--streams`` streaming completions (``ignore_eos``, so they keep decoding),
then sends one completion whose prompt is ``--prompt-mb`` megabytes of text
and probes ``/health`` every ``--probe-interval-ms`` until that request is
answered (the engine tokenizes it, then refuses it as longer than the
context). Probes run in their own process so that the client's stream
reading cannot delay them. Reports p50/p99/max of the probes taken with the
streams alone (baseline) and during the huge request.

    .venv/bin/python benchmarks/serving/health_latency.py            # 64 streams, 10 MB
    .venv/bin/python benchmarks/serving/health_latency.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import report, serving, tokenloom_serve_cmd  # noqa: E402  (stdlib-only helpers of the benchmarks)

WORDS = "the of and to in is was for on that with as by at from his her an which are".split()


def huge_prompt(megabytes: float, seed: int = 0) -> str:
    """``megabytes`` of ordinary-looking text (random common words)."""
    rng = random.Random(seed)
    target = int(megabytes * 1_000_000)
    words = [rng.choice(WORDS) for _ in range(4096)]
    block = " ".join(words) + " "
    return (block * (target // len(block) + 1))[:target]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    if not ms:
        return {"probes": 0}
    return {
        "probes": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
    }


# ------------------------------------------------------------------ prober process


def probe(base_url: str, interval_s: float, ready: Event, stop: Event, out: Any) -> None:
    """GET /health every ``interval_s`` until ``stop``; send (start time, latency) pairs."""
    results: list[tuple[float, float]] = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        client.get("/health")  # connect before the clock starts
        ready.set()
        next_at = time.perf_counter()
        while not stop.is_set():
            start = time.perf_counter()
            status = client.get("/health").status_code
            latency = time.perf_counter() - start
            results.append((time.time(), latency if status == 200 else float("inf")))
            next_at += interval_s
            time.sleep(max(0.0, next_at - time.perf_counter()))
    out.send(results)


# ------------------------------------------------------------------ streams


async def run_streams(
    base_url: str, count: int, max_tokens: int, started: threading.Event, stop: threading.Event
) -> list[int]:
    """``count`` streaming completions; ``started`` is set once every one has a token.
    They are cut (a client disconnect, which aborts them) when ``stop`` is set."""
    tokens = [0] * count
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
    limits = httpx.Limits(max_connections=count + 4)

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def one(i: int) -> None:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        tokens[i] += 1
                        if all(tokens):
                            started.set()
                    if stop.is_set():
                        return

        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        while not stop.is_set():
            done = [t for t in tasks if t.done()]
            for t in done:
                t.result()  # a stream that failed fails the benchmark
            if len(done) == count:
                break
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tokens


# ------------------------------------------------------------------ main


def _start_py_spy(output: Path, pid: int) -> subprocess.Popen[bytes]:
    """Sample the server process's GIL holder (py-spy --gil) without pausing it."""
    exe = Path(sys.executable).with_name("py-spy")
    command = [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid)]
    command += ["--gil", "--nonblocking", "--rate", "200"]
    command += ["--format", "raw", "--output", str(output)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(args: argparse.Namespace, base_url: str, server_pid: int) -> dict[str, Any]:
    prompt = huge_prompt(args.prompt_mb)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    streams_started, stop_streams = threading.Event(), threading.Event()
    stream_tokens: list[int] = []

    def streams_thread() -> None:
        stream_tokens.extend(
            asyncio.run(
                run_streams(base_url, args.streams, args.max_tokens, streams_started, stop_streams)
            )
        )

    streamer = threading.Thread(target=streams_thread, daemon=True)
    streamer.start()
    if not streams_started.wait(args.timeout_s):
        raise TimeoutError(f"the {args.streams} streams did not all start")

    ctx = mp.get_context("spawn")  # not fork: this process already runs threads
    probe_ready, stop_probe = ctx.Event(), ctx.Event()
    receiver, sender = ctx.Pipe(duplex=False)
    interval_s = args.probe_interval_ms / 1000
    prober = ctx.Process(target=probe, args=(base_url, interval_s, probe_ready, stop_probe, sender))
    prober.start()
    try:
        if not probe_ready.wait(args.timeout_s):
            raise TimeoutError("the /health prober did not start")
        time.sleep(args.baseline_s)
        spy = _start_py_spy(args.py_spy, server_pid) if args.py_spy else None
        sent_at = time.time()
        with httpx.Client(base_url=base_url, timeout=args.timeout_s) as client:
            r = client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
        answered_at = time.time()
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    finally:
        stop_probe.set()
        probes: list[tuple[float, float]] = receiver.recv()
        prober.join(timeout=30)
        stop_streams.set()
        streamer.join(timeout=60)

    baseline = [lat for t, lat in probes if t < sent_at]
    during = [lat for t, lat in probes if sent_at <= t <= answered_at]
    slow = sorted(
        ((lat, t - sent_at) for t, lat in probes if sent_at <= t <= answered_at and lat > 0.1),
        reverse=True,
    )
    error = r.json().get("error", {}) if r.status_code != 200 else {}
    return {
        "streams": args.streams,
        "stream_tokens_received": sum(stream_tokens),
        "prompt_bytes": len(prompt.encode()),
        "body_bytes": len(body),
        "huge_request": {
            "status": r.status_code,
            "seconds": round(answered_at - sent_at, 2),
            "param": error.get("param"),
            "message": str(error.get("message", ""))[:200],
        },
        "baseline": summary(baseline),
        "during": summary(during),
        "during_over_100ms": len(slow),
        # The slowest probes: (latency ms, seconds after the huge request was sent).
        "slowest": [(round(lat * 1000), round(at, 2)) for lat, at in slow[:8]],
        "failed_probes": sum(1 for _, lat in probes if lat == float("inf")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1024, help="per stream (they are cut)")
    ap.add_argument("--prompt-mb", type=float, default=10.0)
    ap.add_argument("--probe-interval-ms", type=float, default=20.0)
    ap.add_argument("--baseline-s", type=float, default=3.0, help="probing before the prompt")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--serve-args", default="", help="extra `tokenloom serve` arguments")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound on each wait")
    ap.add_argument("--log", type=Path, default=ROOT / ".bench" / "health-latency-server.log")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument(
        "--py-spy", type=Path, help="profile the server's GIL holder during the huge request"
    )
    args = ap.parse_args()

    base_url = f"http://127.0.0.1:{args.port}"
    serve_cmd = tokenloom_serve_cmd(args.port, args.serve_args)
    with serving(serve_cmd, base_url, args.log, ROOT, timeout_s=args.timeout_s) as server:
        result = measure(args, base_url, server.pid)
    report(result, "benchmarks/serving/health_latency.py", args.json)
    during = result["during"]
    if during.get("probes", 0) and during["p99_ms"] > 100:
        print(f"p99 {during['p99_ms']} ms is above the 100 ms target", file=sys.stderr)


if __name__ == "__main__":
    main()
