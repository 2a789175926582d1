"""Scheduler overhead per step: schedule() + update_from_output(), no model.

Steady decode: N running requests (512-token prompts, block size 16, prefix
caching on, enough blocks), measured over ``--steps`` steps after warm-up.
Mixed: Poisson arrivals of random-length prompts with random output lengths,
so prefills, chunking, decodes and finishes share steps.

The fake runner's work (building ModelRunnerOutput) is outside the timed
region. Reports the median of ``--repeats`` runs.

``--compare TREE`` measures another checkout (e.g. a git worktree of an older
commit) against this one: every run is a fresh subprocess importing tokenloom
from one tree, the two trees alternate run by run (and which goes first
alternates each round), and each row reports the median of ``--repeats`` runs
per tree with the ratio current / TREE.

    .venv/bin/python benchmarks/scheduler_overhead.py
    .venv/bin/python benchmarks/scheduler_overhead.py --profile 1024
    .venv/bin/python benchmarks/scheduler_overhead.py --compare /work/base --repeats 3 --freeze-gc
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
# The tree whose tokenloom is measured: this checkout, or the one --compare runs.
TREE = Path(os.environ.get("TOKENLOOM_BENCH_TREE") or HERE)
sys.path.insert(0, str(TREE))  # runnable from a plain checkout

from tokenloom.config import CacheConfig, SchedulerConfig  # noqa: E402
from tokenloom.core.sched.output import SchedulerOutput  # noqa: E402
from tokenloom.core.sched.scheduler import Scheduler  # noqa: E402
from tokenloom.outputs import ModelRunnerOutput  # noqa: E402
from tokenloom.request import Request  # noqa: E402
from tokenloom.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 512


def fake_run(so: SchedulerOutput, scheduler: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """One token for every request whose scheduled tokens reach its end."""
    requests = scheduler.requests
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([token] if done else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


# The build machine is shared, so the default clock is this thread's CPU time
# (wall time inflates with other processes' load); --wall switches to wall time.
CLOCK = time.thread_time_ns
FREEZE_GC = False


def _timed_step(scheduler: Scheduler) -> tuple[int, int, int]:
    """(schedule ns, update ns, scheduled requests) for one step."""
    clock = CLOCK
    t0 = clock()
    so = scheduler.schedule()
    t1 = clock()
    mro = fake_run(so, scheduler)
    t2 = clock()
    scheduler.update_from_output(so, mro)
    t3 = clock()
    return t1 - t0, t3 - t2, len(so.num_scheduled_tokens)


def steady_decode(n: int, steps: int, seed: int = 0) -> Scheduler:
    """A scheduler holding ``n`` running requests that have finished their prefill."""
    rng = random.Random(seed)
    budget = max(8192, n)
    warmup_steps = n * PROMPT_LEN // budget + 8
    blocks_per_req = -(-(PROMPT_LEN + warmup_steps + steps + 16) // BLOCK_SIZE)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=n * blocks_per_req + 16),
        max_model_len=PROMPT_LEN + warmup_steps + steps + 1024,
    )
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(n):
        prompt = [rng.randrange(32000) for _ in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))
    while any(r.num_output_tokens == 0 for r in scheduler.running) or len(scheduler.waiting):
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_run(so, scheduler))
    for _ in range(5):  # a few decode steps to settle
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_run(so, scheduler))
    return scheduler


def measure_steady(n: int, steps: int, repeats: int, first_seed: int = 0) -> dict[str, float]:
    per_step, per_req, sched_share = [], [], []
    for rep in range(first_seed, first_seed + repeats):
        scheduler = steady_decode(n, steps, seed=rep)
        gc.collect()
        if FREEZE_GC:
            gc.freeze()  # what an engine does after start-up: long-lived objects leave the GC
        total_s = total_u = total_reqs = 0
        for _ in range(steps):
            s, u, k = _timed_step(scheduler)
            total_s += s
            total_u += u
            total_reqs += k
        gc.unfreeze()
        assert total_reqs == n * steps, "steady state lost requests"
        per_step.append((total_s + total_u) / steps / 1e3)
        per_req.append((total_s + total_u) / total_reqs / 1e3)
        sched_share.append(total_s / (total_s + total_u))
    return {
        "us_per_step": statistics.median(per_step),
        "us_per_req": statistics.median(per_req),
        "schedule_share": statistics.median(sched_share),
    }


def measure_mixed(
    steps: int, repeats: int, rate: float = 2.0, first_seed: int = 0
) -> dict[str, float]:
    """Poisson arrivals (``rate`` per step), prompts 32-1024, outputs 8-256 tokens."""
    per_step, per_req, batch = [], [], []
    for rep in range(first_seed, first_seed + repeats):
        rng = random.Random(100 + rep)
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=8192),
            max_model_len=4096,
        )
        shared = [rng.randrange(32000) for _ in range(256)]  # a common system prompt
        total_ns = total_reqs = 0
        next_id = 0
        for _ in range(steps):
            # Knuth's Poisson sampler: few arrivals per step.
            limit, k, p = 2.718281828 ** (-rate), 0, rng.random()
            while p > limit:
                k += 1
                p *= rng.random()
            for _ in range(k):
                length = rng.randint(32, 1024)
                prefix = shared[: min(length // 2, 256)] if rng.random() < 0.5 else []
                prompt = prefix + [rng.randrange(32000) for _ in range(length - len(prefix))]
                params = SamplingParams(max_tokens=rng.randint(8, 256), ignore_eos=True)
                scheduler.add_request(Request(f"m-{next_id}", prompt, params))
                next_id += 1
            s, u, n = _timed_step(scheduler)
            total_ns += s + u
            total_reqs += n
        per_step.append(total_ns / steps / 1e3)
        per_req.append(total_ns / max(total_reqs, 1) / 1e3)
        batch.append(total_reqs / steps)
    return {
        "us_per_step": statistics.median(per_step),
        "us_per_req": statistics.median(per_req),
        "mean_batch": statistics.median(batch),
    }


def profile(n: int, steps: int) -> None:
    scheduler = steady_decode(n, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        so = scheduler.schedule()
        mro = fake_run(so, scheduler)
        scheduler.update_from_output(so, mro)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def _run_one(workload: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """One run of one workload ("mixed" or a steady N), as --compare's subprocesses do."""
    if workload == "mixed":
        return measure_mixed(args.mixed_steps, 1, first_seed=seed)
    return measure_steady(int(workload), args.steps, 1, first_seed=seed)


def _tree_label(tree: Path) -> str:
    """``<short commit>`` (``+`` when the tree has uncommitted changes), or the path."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)
    return commit + ("+" if dirty else "")


def compare(base: Path, args: argparse.Namespace) -> None:
    """Interleaved subprocess runs of ``base`` and this tree; medians and ratios."""
    trees = {"base": base.resolve(), "current": HERE}
    workloads = [str(n) for n in args.sizes] + (["mixed"] if args.mixed_steps else [])
    flags = ["--steps", str(args.steps), "--mixed-steps", str(args.mixed_steps)]
    flags += ["--wall"] * args.wall + ["--freeze-gc"] * args.freeze_gc
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rep in range(args.repeats):
        for workload in workloads:
            order = ["base", "current"] if rep % 2 == 0 else ["current", "base"]
            for name in order:
                env = dict(os.environ, TOKENLOOM_BENCH_TREE=str(trees[name]))
                cmd = [sys.executable, str(Path(__file__).resolve()), "--one", workload]
                done = subprocess.run(
                    [*cmd, "--seed", str(rep), *flags],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if not result.pop("tree").startswith(str(trees[name])):
                    raise RuntimeError(f"{name} run imported tokenloom from the wrong tree")
                runs.setdefault((workload, name), []).append(result)
                print(
                    f"  round {rep + 1}, {workload:>5}, {name:>7}: "
                    f"{result['us_per_step']:.1f} us/step",
                    file=sys.stderr,
                    flush=True,
                )

    clock = "wall" if args.wall else "thread CPU"
    print(
        f"base = {trees['base']} ({_tree_label(trees['base'])}), "
        f"current = {HERE} ({_tree_label(HERE)})"
    )
    print(
        f"clock: {clock} time; median of {args.repeats} interleaved subprocess runs per tree; "
        f"steady decode {args.steps} steps, mixed {args.mixed_steps} steps"
        + ("; gc frozen after warm-up" if args.freeze_gc else "")
    )
    print("| workload | base µs/step | current µs/step | ratio | base µs/req | current µs/req |")
    print("|---|---:|---:|---:|---:|---:|")
    for workload in workloads:
        med = {
            name: {
                k: statistics.median(r[k] for r in runs[(workload, name)])
                for k in runs[(workload, name)][0]
            }
            for name in trees
        }
        label = f"N={workload}" if workload != "mixed" else "mixed"
        b, c = med["base"], med["current"]
        print(
            f"| {label} | {b['us_per_step']:.1f} | {c['us_per_step']:.1f} | "
            f"{c['us_per_step'] / b['us_per_step']:.3f} | {b['us_per_req']:.2f} | "
            f"{c['us_per_req']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mixed-steps", type=int, default=2000, help="0: no mixed workload")
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile N steady requests")
    parser.add_argument("--wall", action="store_true", help="wall clock instead of CPU time")
    parser.add_argument(
        "--freeze-gc", action="store_true", help="gc.freeze() after warm-up (steady decode)"
    )
    parser.add_argument(
        "--compare", type=Path, metavar="TREE", help="measure TREE against this checkout"
    )
    # Internal: one run of one workload in a --compare subprocess, printed as JSON.
    parser.add_argument("--one", metavar="WORKLOAD", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global CLOCK, FREEZE_GC
    if args.wall:
        CLOCK = time.perf_counter_ns
    FREEZE_GC = args.freeze_gc
    if args.profile:
        profile(args.profile, args.steps)
        return
    if args.one:
        import tokenloom

        result: dict[str, object] = dict(_run_one(args.one, args.seed, args))
        result["tree"] = str(Path(tokenloom.__file__).resolve().parents[1])
        print(json.dumps(result))
        return
    if args.compare:
        compare(args.compare, args)
        return
    clock = "wall" if args.wall else "thread CPU"
    print(f"steady decode, block {BLOCK_SIZE}, {PROMPT_LEN}-token prompts, prefix caching on")
    print(
        f"clock: {clock} time; median of {args.repeats} runs of {args.steps} steps"
        + ("; gc frozen after warm-up" if args.freeze_gc else "")
    )
    print(f"{'N':>6} {'us/step':>10} {'us/req':>8} {'schedule %':>10}")
    for n in args.sizes:
        r = measure_steady(n, args.steps, args.repeats)
        print(
            f"{n:>6} {r['us_per_step']:>10.1f} {r['us_per_req']:>8.2f} "
            f"{100 * r['schedule_share']:>9.0f}%"
        )
    if not args.mixed_steps:
        return
    r = measure_mixed(args.mixed_steps, max(1, args.repeats // 2))
    print(
        f"mixed (Poisson 2/step, 256 seqs, 2048 tokens): {r['us_per_step']:.1f} us/step, "
        f"{r['us_per_req']:.2f} us/req, mean batch {r['mean_batch']:.0f}"
    )


if __name__ == "__main__":
    main()
