"""Helpers shared by the benchmark scripts and the peer workers (stdlib + psutil only).

Every worker is run with its own engine's Python (the vLLM venv, the main
venv, ...), so this file must not import tokenloom or any engine.
Protocol: a worker loads its engine (untimed), runs the same warm-up
(untimed), then for each workload and repeat resets any prefix cache, waits
for the machine to calm down, and times one pass over the whole workload.
It writes JSON: {"engine", "config", "load_s", "runs": {workload: [run...]},
"single": [...], "rss_mb"} where a run is {"wall_s", "output_tokens": [per
request], "cached_tokens", "own_cpu_s", "other_cpu_s", "busy_wait_s"}.

Single stream (``--single PROMPT:OUT``): one request at a time, greedy. Each
repeat times a prompt with 1 output token (the prefill: prompt tok/s) and
another of the same length with OUT tokens; decode ms/token = (t_OUT - t_1) /
(OUT - 1), the same arithmetic for every engine, and the same from the engine's
own CPU time. Every request's prompt differs from the first token on, so no
prefix cache serves any of it (with one prompt for both, a cache made every
repeat after the first a cached prefill). ``rss_mb`` is the resident memory of
the worker's process tree (the engine's processes included) after the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

# The same untimed warm-up for every engine: 4 prompts of 32 tokens, 8 tokens out.
WARMUP = [{"prompt_token_ids": [100 + i + j for j in range(32)], "max_tokens": 8} for i in range(4)]


def wait_healthy(
    base_url: str, proc: subprocess.Popen, name: str = "server", timeout_s: float = 300.0
) -> None:
    """Poll ``{base_url}/health`` until it answers 200; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # refused, reset or timed out while it starts
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} at {base_url} not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def serving(
    cmd: list[str], base_url: str, log_path: Path, cwd: Path, timeout_s: float = 300.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server command in its own session (output to ``log_path``) until it is
    healthy; on exit stop its whole process group, killing it if it lingers."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_healthy(base_url, server, timeout_s=timeout_s)
            yield server
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def tokenloom_serve_cmd(port: int, serve_args: str) -> list[str]:
    """``tokenloom serve`` on 127.0.0.1:``port`` with this interpreter, plus ``serve_args``."""
    return [
        sys.executable, "-m", "tokenloom.entrypoints.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port), *shlex.split(serve_args),
    ]  # fmt: skip


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (what a figure was measured on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(result: dict[str, Any], script: str, json_path: Path | None) -> None:
    """Add the command line and machine to a benchmark's result, print it as JSON and
    also write it to ``json_path`` when given."""
    result["command"] = f"python {script} " + shlex.join(sys.argv[1:])
    result["cpu"] = cpu_model()
    result["cpus"] = os.cpu_count()
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text + "\n")


def load_workload(path: str) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())


def _busy(t: Any) -> float:
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0))


def _own_tree_cpu() -> float:
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


class CpuMonitor:
    """CPU seconds used by other processes (machine busy time minus our process tree)."""

    def __enter__(self) -> CpuMonitor:
        self._busy0, self._own0, self._t0 = _busy(psutil.cpu_times()), _own_tree_cpu(), time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.own_cpu_s = _own_tree_cpu() - self._own0
        self.other_cpu_s = max(0.0, _busy(psutil.cpu_times()) - self._busy0 - self.own_cpu_s)


def wait_for_idle(max_wait_s: float, threshold: float = 0.25) -> float:
    """Wait (up to max_wait_s) until others use < threshold of the cores; returns seconds waited."""
    t0 = time.time()
    ncpu = psutil.cpu_count() or 1
    while time.time() - t0 < max_wait_s:
        own0, busy0 = _own_tree_cpu(), _busy(psutil.cpu_times())
        time.sleep(1.0)
        other = _busy(psutil.cpu_times()) - busy0 - (_own_tree_cpu() - own0)
        if other < threshold * ncpu:
            break
    return time.time() - t0


def worker_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", action="append", default=[], help="NAME=path.json")
    ap.add_argument("--single", default="", help="PROMPT:OUT single-stream measurement (off: '')")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--idle-wait", type=float, default=30.0, help="max seconds to wait for idle")
    ap.add_argument("--threads", type=int, default=2)
    return ap


def tree_rss_mb() -> float:
    """Resident memory of this process and its descendants, in MB."""
    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 1e6


def single_prompt(prompt_len: int, variant: int) -> list[int]:
    """Single-stream prompt number ``variant``: fixed token ids, the same for every
    engine; two variants differ at every position, the first included."""
    return [100 + (37 * i + 101 * variant) % 20000 for i in range(prompt_len)]


def run_single(
    args: argparse.Namespace, generate_one: Callable[[list[int], int], int], engine: str
) -> list[dict[str, Any]]:
    """Batch-1 prefill and decode timings (see the module docstring)."""
    prompt_len, out_len = (int(x) for x in args.single.split(":"))
    generate_one(single_prompt(32, 0), 4)  # warm-up at this batch size
    runs = []
    for rep in range(args.repeats):
        waited = wait_for_idle(args.idle_wait)
        with CpuMonitor() as mon:
            with CpuMonitor() as first:
                t0 = time.perf_counter()
                assert generate_one(single_prompt(prompt_len, 2 * rep + 1), 1) == 1
                t1 = time.perf_counter()
            with CpuMonitor() as whole:
                produced = generate_one(single_prompt(prompt_len, 2 * rep + 2), out_len)
                t2 = time.perf_counter()
        if produced != out_len:
            raise RuntimeError(f"{engine} produced {produced} tokens, asked for {out_len}")
        run = {
            "prompt_tokens": prompt_len,
            "output_tokens": out_len,
            "prefill_s": t1 - t0,
            "total_s": t2 - t1,
            "decode_ms_per_token": (t2 - t1 - (t1 - t0)) / (out_len - 1) * 1e3,
            "prompt_tok_s": prompt_len / (t1 - t0),
            "other_cpu_s": mon.other_cpu_s,
            "busy_wait_s": waited,
            # CPU time of the engine's own processes per decoded token: less sensitive
            # to a crowded machine than wall time (spinning threads inflate it).
            "decode_cpu_ms_per_token": (whole.own_cpu_s - first.own_cpu_s) / (out_len - 1) * 1e3,
        }
        runs.append(run)
        print(
            f"[{engine}] single rep {rep + 1}/{args.repeats}: decode "
            f"{run['decode_ms_per_token']:.1f} ms/token, prompt {run['prompt_tok_s']:.0f} tok/s, "
            f"other procs {mon.other_cpu_s:.1f} cpu-s",
            flush=True,
        )
    return runs


def run_all(
    args: argparse.Namespace,
    run_once: Callable[[list[dict[str, Any]]], tuple[list[int], int]],
    reset_cache: Callable[[], object],
    engine: str,
    config: dict[str, Any],
    load_s: float,
    generate_one: Callable[[list[int], int], int] | None = None,
) -> None:
    """Warm up, then time ``run_once(workload) -> (output token counts, cached tokens)``,
    and, with ``--single``, ``generate_one(prompt ids, max_tokens) -> tokens produced``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_once(WARMUP)
    reset_cache()
    runs: dict[str, list[dict[str, Any]]] = {}
    for spec in args.workload:
        name, path = spec.split("=", 1)
        workload = load_workload(path)
        runs[name] = []
        for rep in range(args.repeats):
            reset_cache()
            waited = wait_for_idle(args.idle_wait)
            with CpuMonitor() as mon:
                t0 = time.perf_counter()
                counts, cached = run_once(workload)
                wall = time.perf_counter() - t0
            run = {
                "wall_s": wall,
                "output_tokens": counts,
                "cached_tokens": cached,
                "own_cpu_s": mon.own_cpu_s,
                "other_cpu_s": mon.other_cpu_s,
                "busy_wait_s": waited,
            }
            runs[name].append(run)
            # Written after every run, so a worker stopped early still leaves its results.
            partial = {"engine": engine, "config": config, "load_s": load_s, "runs": runs}
            Path(args.out).write_text(json.dumps({**partial, "partial": True}))
            print(
                f"[{engine}] {name} rep {rep + 1}/{args.repeats}: {wall:.2f} s, "
                f"{sum(counts)} out tokens, other procs {mon.other_cpu_s:.1f} cpu-s",
                flush=True,
            )
    out = {"engine": engine, "config": config, "load_s": load_s, "runs": runs}
    if args.single and generate_one is not None:
        reset_cache()
        out["single"] = run_single(args, generate_one, engine)
    out["rss_mb"] = tree_rss_mb()
    Path(args.out).write_text(json.dumps(out))
