"""Scheduler overhead per step: schedule() + update_from_output(), no model.

Steady decode: N running requests (512-token prompts, block size 16, prefix
caching on, enough blocks), measured over ``--steps`` steps after warm-up.
Mixed: Poisson arrivals of random-length prompts with random output lengths,
so prefills, chunking, decodes and finishes share steps.

The fake runner's work (building ModelRunnerOutput) is outside the timed
region. Reports the median of ``--repeats`` runs.

``--policy`` picks the scheduling policy (a tree that does not know it runs
fcfs, and the table says so); ``--tenants K`` spreads the requests round
robin over K tenants with weights 1..K, or all 1 with ``--equal-weights``
(trees without tenants ignore it). With weights 1..K the fair policy admits
the requests in another order than they were made (it still walks them in
arrival order, as FCFS does); equal weights keep the admission order too.

``--compare TREE`` measures another checkout (e.g. a git worktree of an older
commit) against this one in one invocation. Each round is one fresh subprocess
per workload that imports tokenloom from both trees (as two private copies),
builds the same workload (same seed) on both, and times them side by side,
alternating in windows of steps (16 for steady decode: one block cycle; 50 for
mixed) in ABBA order, so both see the same machine state; on a shared machine
that state swings by far more than the difference measured. Side by side,
automatic garbage collection is off (young generations are collected between
windows, untimed), since a collection would walk both trees' objects. Each row
gives the median over ``--repeats`` rounds per tree and the median of the
rounds' current / TREE ratios.

``--base-policy P`` times policy P of this checkout (or of TREE) as the base
against ``--policy`` of this checkout, side by side in the same way: the fair
policy's overhead over FCFS is ``--policy fair --base-policy fcfs``. Both runs
get the same requests (same tenants and weights).

    .venv/bin/python benchmarks/scheduler/scheduler_overhead.py
    .venv/bin/python benchmarks/scheduler/scheduler_overhead.py --profile 1024
    .venv/bin/python benchmarks/scheduler/scheduler_overhead.py --compare /work/base --repeats 3 --freeze-gc
    .venv/bin/python benchmarks/scheduler/scheduler_overhead.py --compare /work/base --policy fair --tenants 4
    .venv/bin/python benchmarks/scheduler/scheduler_overhead.py --policy fair --base-policy fcfs --tenants 4 --freeze-gc
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import inspect
import json
import pstats
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]  # the repository
BLOCK_SIZE = 16
PROMPT_LEN = 512
STEADY_WINDOW = 16  # steps: every request crosses one block boundary per window
MIXED_WINDOW = 50

# The build machine is shared, so the default clock is this thread's CPU time
# (wall time inflates with other processes' load); --wall switches to wall time.
CLOCK = time.thread_time_ns
FREEZE_GC = False
POLICY = "fcfs"
TENANTS = 1
EQUAL_WEIGHTS = False


@dataclass(frozen=True)
class Tree:
    """The classes the benchmark drives, imported from one checkout's tokenloom."""

    path: Path
    Scheduler: Any
    Request: Any
    SamplingParams: Any
    SchedulerConfig: Any
    CacheConfig: Any
    ModelRunnerOutput: Any
    policy: str  # the policy it runs: POLICY, or fcfs where it does not know POLICY
    has_tenants: bool

    def config(self, **kwargs: Any) -> Any:
        return self.SchedulerConfig(policy=self.policy, **kwargs)

    def request(
        self, index: int, req_id: str, prompt: list[int], params: Any, **kwargs: Any
    ) -> Any:
        """Request number ``index``; with tenants, of tenant k = ``index % TENANTS``
        (weight k+1, or 1 with EQUAL_WEIGHTS)."""
        if self.has_tenants and TENANTS > 1:
            k = index % TENANTS
            kwargs.update(tenant=f"t{k}", tenant_weight=1.0 if EQUAL_WEIGHTS else float(k + 1))
        return self.Request(req_id, prompt, params, **kwargs)


def load_tree(path: Path, policy: str | None = None) -> Tree:
    """Import tokenloom from ``path`` as a private copy, to run ``policy`` (default
    POLICY; fcfs where the tree does not know it).

    Its modules leave ``sys.modules`` again afterwards (they keep referring to
    one another), so two trees can be loaded into one process.
    """
    path = path.resolve()

    def is_ours(name: str) -> bool:
        return name == "tokenloom" or name.startswith("tokenloom.")

    stashed = {name: sys.modules.pop(name) for name in list(sys.modules) if is_ours(name)}
    sys.path.insert(0, str(path))
    try:
        package = importlib.import_module("tokenloom")
        if not Path(str(package.__file__)).resolve().is_relative_to(path):
            raise RuntimeError(f"tokenloom came from {package.__file__}, not {path}")
        config = importlib.import_module("tokenloom.config")
        request_class = importlib.import_module("tokenloom.request").Request
        policy = POLICY if policy is None else policy
        try:
            config.SchedulerConfig(policy=policy)
        except ValueError:
            policy = "fcfs"
        tree = Tree(
            path=path,
            Scheduler=importlib.import_module("tokenloom.core.sched.scheduler").Scheduler,
            Request=request_class,
            SamplingParams=importlib.import_module("tokenloom.sampling_params").SamplingParams,
            SchedulerConfig=config.SchedulerConfig,
            CacheConfig=config.CacheConfig,
            ModelRunnerOutput=importlib.import_module("tokenloom.outputs").ModelRunnerOutput,
            policy=policy,
            has_tenants="tenant" in inspect.signature(request_class).parameters,
        )
    finally:
        sys.path.remove(str(path))
        for name in [name for name in sys.modules if is_ours(name)]:
            del sys.modules[name]
        sys.modules.update(stashed)
    return tree


def fake_run(tree: Tree, so: Any, scheduler: Any, token: int = 7) -> Any:
    """One token for every request whose scheduled tokens reach its end."""
    requests = scheduler.requests
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= len(request.all_token_ids)
        sampled.append([token] if done else [])
    return tree.ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def _timed_step(tree: Tree, scheduler: Any) -> tuple[int, int, int]:
    """(schedule ns, update ns, scheduled requests) for one step."""
    clock = CLOCK
    t0 = clock()
    so = scheduler.schedule()
    t1 = clock()
    mro = fake_run(tree, so, scheduler)
    t2 = clock()
    scheduler.update_from_output(so, mro)
    t3 = clock()
    return t1 - t0, t3 - t2, len(so.num_scheduled_tokens)


def steady_decode(tree: Tree, n: int, steps: int, seed: int = 0) -> Any:
    """A scheduler holding ``n`` running requests that have finished their prefill."""
    rng = random.Random(seed)
    budget = max(8192, n)
    warmup_steps = n * PROMPT_LEN // budget + 8
    blocks_per_req = -(-(PROMPT_LEN + warmup_steps + steps + 16) // BLOCK_SIZE)
    scheduler = tree.Scheduler(
        tree.config(max_num_seqs=n, max_num_batched_tokens=budget),
        tree.CacheConfig(block_size=BLOCK_SIZE, num_blocks=n * blocks_per_req + 16),
        max_model_len=PROMPT_LEN + warmup_steps + steps + 1024,
    )
    params = tree.SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(n):
        prompt = [rng.randrange(32000) for _ in range(PROMPT_LEN)]
        scheduler.add_request(tree.request(i, f"req-{i}", prompt, params, eos_token_id=2))
    while any(not r.output_token_ids for r in scheduler.running) or len(scheduler.waiting):
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_run(tree, so, scheduler))
    for _ in range(5):  # a few decode steps to settle
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_run(tree, so, scheduler))
    return scheduler


def mixed_scheduler(tree: Tree) -> Any:
    return tree.Scheduler(
        tree.config(max_num_seqs=256, max_num_batched_tokens=2048),
        tree.CacheConfig(block_size=BLOCK_SIZE, num_blocks=8192),
        max_model_len=4096,
    )


def mixed_arrivals(seed: int, rate: float = 2.0) -> Iterator[list[tuple[list[int], int]]]:
    """Per step: Poisson(``rate``) new (prompt, max_tokens); prompts 32-1024, outputs 8-256."""
    rng = random.Random(100 + seed)
    shared = [rng.randrange(32000) for _ in range(256)]  # a common system prompt
    limit = 2.718281828 ** (-rate)
    while True:
        # Knuth's Poisson sampler: few arrivals per step.
        k, p = 0, rng.random()
        while p > limit:
            k += 1
            p *= rng.random()
        step = []
        for _ in range(k):
            length = rng.randint(32, 1024)
            prefix = shared[: min(length // 2, 256)] if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(32000) for _ in range(length - len(prefix))]
            step.append((prompt, rng.randint(8, 256)))
        yield step


class _Run:
    """One tree's scheduler under measurement, with running totals."""

    def __init__(self, tree: Tree, scheduler: Any, arrivals: Iterator | None = None) -> None:
        self.tree = tree
        self.scheduler = scheduler
        self.arrivals = arrivals
        self.next_id = 0
        self.steps = self.sched_ns = self.update_ns = self.scheduled = 0

    def step(self) -> None:
        if self.arrivals is not None:
            tree = self.tree
            for prompt, max_tokens in next(self.arrivals):
                params = tree.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                self.scheduler.add_request(
                    tree.request(self.next_id, f"m-{self.next_id}", prompt, params)
                )
                self.next_id += 1
        s, u, k = _timed_step(self.tree, self.scheduler)
        self.steps += 1
        self.sched_ns += s
        self.update_ns += u
        self.scheduled += k

    def result(self) -> dict[str, float]:
        total = self.sched_ns + self.update_ns
        return {
            "us_per_step": total / self.steps / 1e3,
            "us_per_req": total / max(self.scheduled, 1) / 1e3,
            "schedule_share": self.sched_ns / max(total, 1),
            "mean_batch": self.scheduled / self.steps,
        }


def _prepare(trees: list[Tree], workload: str, steps: int, seed: int) -> list[_Run]:
    if workload == "mixed":
        return [_Run(t, mixed_scheduler(t), mixed_arrivals(seed)) for t in trees]
    return [_Run(t, steady_decode(t, int(workload), steps, seed)) for t in trees]


def measure(trees: list[Tree], workload: str, steps: int, seed: int) -> list[dict[str, float]]:
    """One run of ``workload`` per tree; with two trees, side by side in ABBA windows.

    Side by side, a collection triggered by one tree's allocations would walk
    both trees' objects inside the other's timed step, so automatic collection
    is off and the young generations are collected between windows, untimed.
    """
    runs = _prepare(trees, workload, steps, seed)
    window = MIXED_WINDOW if workload == "mixed" else STEADY_WINDOW
    paired = len(runs) > 1
    gc.collect()
    freeze = FREEZE_GC and workload != "mixed"
    if freeze:
        gc.freeze()  # what an engine does after start-up: long-lived objects leave the GC
    if paired:
        gc.disable()
    done = 0
    windows = 0
    while done < steps:
        count = min(window, steps - done)
        for run in runs if windows % 2 == 0 else runs[::-1]:
            for _ in range(count):
                run.step()
            if paired:
                gc.collect(1)
        done += count
        windows += 1
    if paired:
        gc.enable()
    if freeze:
        gc.unfreeze()
    if workload != "mixed":
        for run in runs:
            assert run.scheduled == int(workload) * steps, "steady state lost requests"
    return [run.result() for run in runs]


def measure_repeated(tree: Tree, workload: str, steps: int, repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` runs (seeds 0..repeats-1) of one tree."""
    results = [measure([tree], workload, steps, seed)[0] for seed in range(repeats)]
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def profile(tree: Tree, n: int, steps: int) -> None:
    scheduler = steady_decode(tree, n, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        so = scheduler.schedule()
        mro = fake_run(tree, so, scheduler)
        scheduler.update_from_output(so, mro)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def _tree_label(path: Path) -> str:
    """``<short commit>`` (``+`` when the tree has uncommitted changes), or the path."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(path)
    return commit + ("+" if dirty else "")


def compare(base: Path, args: argparse.Namespace) -> None:
    """One subprocess per round and workload, timing both trees side by side."""
    workloads = [str(n) for n in args.sizes] + (["mixed"] if args.mixed_steps else [])
    flags = ["--steps", str(args.steps), "--mixed-steps", str(args.mixed_steps)]
    flags += ["--wall"] * args.wall + ["--freeze-gc"] * args.freeze_gc
    flags += ["--policy", args.policy, "--tenants", str(args.tenants)]
    flags += ["--equal-weights"] * args.equal_weights
    flags += ["--base-policy", args.base_policy] if args.base_policy else []
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {w: [] for w in workloads}
    for rep in range(args.repeats):
        for workload in workloads:
            done = subprocess.run(
                [sys.executable, __file__, "--pair", str(base), workload, "--seed", str(rep)]
                + flags,
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rounds[workload].append(result)
            b, c = result["base"]["us_per_step"], result["current"]["us_per_step"]
            print(
                f"  round {rep + 1}, {workload:>5}: base {b:.1f}, current {c:.1f} us/step",
                file=sys.stderr,
                flush=True,
            )

    clock = "wall" if args.wall else "thread CPU"
    base_policy = load_tree(base, args.base_policy).policy
    print(
        f"base = {base.resolve()} ({_tree_label(base)}, policy {base_policy}), "
        f"current = {HERE} ({_tree_label(HERE)}, policy {load_tree(HERE).policy}); "
        f"{args.tenants} tenant(s)" + (" of equal weight" if args.equal_weights else "")
    )
    print(
        f"clock: {clock} time; {args.repeats} rounds, each a subprocess timing both trees side "
        f"by side; steady decode {args.steps} steps, mixed {args.mixed_steps} steps"
        + ("; gc frozen after warm-up" if args.freeze_gc else "")
    )
    print(
        "| workload | base µs/step | current µs/step | ratio | base µs/req | current µs/req "
        "| ratio per round |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for workload in workloads:
        results = rounds[workload]
        med = {
            name: {k: statistics.median(r[name][k] for r in results) for k in results[0][name]}
            for name in ("base", "current")
        }
        ratios = [r["current"]["us_per_step"] / r["base"]["us_per_step"] for r in results]
        b, c = med["base"], med["current"]
        label = f"N={workload}" if workload != "mixed" else "mixed"
        print(
            f"| {label} | {b['us_per_step']:.1f} | {c['us_per_step']:.1f} | "
            f"{statistics.median(ratios):.3f} | {b['us_per_req']:.2f} | {c['us_per_req']:.2f} | "
            + " ".join(f"{r:.3f}" for r in ratios)
            + " |"
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
    parser.add_argument(
        "--policy", default="fcfs", help="scheduling policy (a tree without it runs fcfs)"
    )
    parser.add_argument(
        "--base-policy",
        metavar="POLICY",
        help="time this policy (of --compare TREE, else of this checkout) as the base",
    )
    parser.add_argument(
        "--tenants", type=int, default=1, help="spread requests over this many tenants"
    )
    parser.add_argument(
        "--equal-weights", action="store_true", help="every tenant weight 1 (default: 1..K)"
    )
    # Internal: one --compare round of one workload, printed as JSON.
    parser.add_argument("--pair", nargs=2, metavar=("TREE", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global CLOCK, FREEZE_GC, POLICY, TENANTS, EQUAL_WEIGHTS
    if args.wall:
        CLOCK = time.perf_counter_ns
    FREEZE_GC = args.freeze_gc
    POLICY, TENANTS, EQUAL_WEIGHTS = args.policy, args.tenants, args.equal_weights
    if args.pair:
        base_path, workload = args.pair
        trees = [load_tree(Path(base_path), args.base_policy), load_tree(HERE)]
        steps = args.mixed_steps if workload == "mixed" else args.steps
        base, current = measure(trees, workload, steps, args.seed)
        print(json.dumps({"base": base, "current": current}))
        return
    if args.compare or args.base_policy:
        compare(args.compare or HERE, args)
        return
    tree = load_tree(HERE)
    if args.profile:
        profile(tree, args.profile, args.steps)
        return
    clock = "wall" if args.wall else "thread CPU"
    print(
        f"steady decode, block {BLOCK_SIZE}, {PROMPT_LEN}-token prompts, prefix caching on; "
        f"policy {tree.policy}, {TENANTS} tenant(s)"
    )
    print(
        f"clock: {clock} time; median of {args.repeats} runs of {args.steps} steps"
        + ("; gc frozen after warm-up" if args.freeze_gc else "")
    )
    print(f"{'N':>6} {'us/step':>10} {'us/req':>8} {'schedule %':>10}")
    for n in args.sizes:
        r = measure_repeated(tree, str(n), args.steps, args.repeats)
        print(
            f"{n:>6} {r['us_per_step']:>10.1f} {r['us_per_req']:>8.2f} "
            f"{100 * r['schedule_share']:>9.0f}%"
        )
    if not args.mixed_steps:
        return
    r = measure_repeated(tree, "mixed", args.mixed_steps, max(1, args.repeats // 2))
    print(
        f"mixed (Poisson 2/step, 256 seqs, 2048 tokens): {r['us_per_step']:.1f} us/step, "
        f"{r['us_per_req']:.2f} us/req, mean batch {r['mean_batch']:.0f}"
    )


if __name__ == "__main__":
    main()
