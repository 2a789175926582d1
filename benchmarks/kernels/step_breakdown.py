"""Where a batch-1 decode step goes: per phase and per op, against the time the
model's weights take to stream from memory.

One request (a PROMPT-token prompt, greedy) runs through the real Scheduler and
ModelRunner on the default model; after its prefill and a warm-up, STEPS decode
steps are timed. Phases are timed by wrapping the runner's own functions:
inputs (``apply_deltas`` + ``prepare_step``), attention metadata, the model
forward, logits, sampling, and the rest (scheduler, output). Then a few steps
run under torch's profiler for a per-op table (self CPU time). Last, a few
steps run two pieces of the host's work (the sampling metadata, the embedding)
twice in a row: at their place in the step, on caches that the weights
streaming through have just emptied, and again right after, on warm ones.

The floor: bytes of the weights one step reads (every layer's matrices and the
LM head; norms are negligible) over the memory read bandwidth measured here
(a sum over a buffer larger than the caches, on the same threads and on huge
pages as the weights). A shared host's bandwidth swings by up to 2x from
minute to minute, so the timed steps run in ``--bandwidth-rounds`` rounds, each
right after its own bandwidth measurement: the step against the floor is the
median of the rounds' ratios. The best bandwidth seen gives the strictest
floor, also reported.

    .venv/bin/python benchmarks/kernels/step_breakdown.py                 # float32, 2 threads
    .venv/bin/python benchmarks/kernels/step_breakdown.py --kv-cache-dtype bfloat16 --json out.json

``--host-time`` measures instead the host's work of a whole engine step outside
the model: one request decoded through ``LLM`` (scheduler, runner, front end),
synchronously and with ``--async-scheduling``, alternated in ABBA rounds in one
process; per step, the wall time less the forward pass and the LM head, with
the phases of ``benchmarks/gpu/step_clock.py``. On a GPU this host work sits
between two steps unless async scheduling hides it.

    .venv/bin/python benchmarks/kernels/step_breakdown.py --host-time --steps 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from step_clock import PhaseTimer, clock_engine, per_step_ms  # noqa: E402

# Steps that time host pieces twice (cold_and_warm), after the timed ones.
HOST_STEPS = 20


class ReadBandwidth:
    """GB/s of summing a float32 buffer far larger than the caches, on huge pages as
    the weights are (``huge_pages.WeightArena``): on 4 KB pages the same sum reads
    up to a fifth slower, a floor the weights could beat."""

    def __init__(self, megabytes: int = 512) -> None:
        import torch

        from tokenloom.model import huge_pages

        self.buffer = huge_pages.zeros((megabytes * 2**20 // 4,), torch.float32, "cpu").fill_(1.0)
        self.buffer.sum()

    def measure(self, repeats: int = 3) -> float:
        """The best of ``repeats`` sums, taken back to back."""
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.buffer.sum()
            best = max(best, self.buffer.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        return best


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of the matrices one token's forward reads: every linear layer and the
    LM head (the embedding gathers one row; norms are tiny)."""
    import torch

    from tokenloom.model.panel_linear import PanelLinear
    from tokenloom.quantization.linear import QuantLinear

    if any(isinstance(m, QuantLinear) for m in model.modules()):
        # Quantized: every QuantLinear (projections and the head, tied or not) once.
        seen = {
            id(m.qweight): m.qweight.nbytes for m in model.modules() if isinstance(m, QuantLinear)
        }
        return sum(seen.values())
    if any(isinstance(m, PanelLinear) for m in model.modules()):
        # Float panels: every PanelLinear (projections and the head, tied or not) once.
        panels = {
            id(m.weight_panels): m.weight_panels.nbytes
            for m in model.modules()
            if isinstance(m, PanelLinear)
        }
        return sum(panels.values())
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and module is not model.embed_tokens
        ):
            total += weight.numel() * weight.element_size()
    if model.lm_head is None:  # tied: the head reads the embedding matrix
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled GGUF")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps")
    ap.add_argument(
        "--bandwidth-rounds",
        type=int,
        default=5,
        help="rounds of steps, each after its own bandwidth measurement",
    )
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15, help="ops listed")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--host-time", action="store_true", help="host time per engine step")
    ap.add_argument("--rounds", type=int, default=3, help="--host-time: ABBA rounds")
    args = ap.parse_args()
    if args.profile_steps < 1:
        ap.error("--profile-steps must be at least 1 (the op table averages over them)")
    if args.host_time:
        host_time(args)
        return

    import torch

    torch.set_num_threads(args.threads)
    from _common import cpu_model

    import tokenloom.worker.model_runner as runner_module
    from tokenloom.config import CacheConfig, ModelConfig, SchedulerConfig
    from tokenloom.core.sched.scheduler import Scheduler
    from tokenloom.request import Request
    from tokenloom.sampling_params import SamplingParams
    from tokenloom.worker.model_runner import ModelRunner

    warmup = 10
    total_tokens = args.prompt + warmup + args.steps + args.profile_steps + HOST_STEPS + 2
    block_size = 16
    num_blocks = -(-total_tokens // block_size) + 2
    # cache_dtype only when asked for, so that this script also runs on older trees.
    extra = {} if args.kv_cache_dtype == "auto" else {"cache_dtype": args.kv_cache_dtype}
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks, **extra)
    scheduler_config = SchedulerConfig(max_num_seqs=1)
    model_config = ModelConfig(model=args.model, dtype=args.dtype, max_model_len=total_tokens + 16)
    runner = ModelRunner(model_config, cache_config, scheduler_config)
    scheduler = Scheduler(scheduler_config, cache_config, runner.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=total_tokens - args.prompt, ignore_eos=True)
    prompt = [(7 * i + 100) % runner.arch.vocab_size for i in range(args.prompt)]
    scheduler.add_request(Request("r0", prompt, params, eos_token_id=runner.eos_token_ids[0]))

    timer = PhaseTimer()
    runner_module.apply_deltas = timer.wrap("inputs", runner_module.apply_deltas)
    runner_module.prepare_step = timer.wrap("inputs", runner_module.prepare_step)
    runner_module.build_sampling_metadata = timer.wrap(
        "sampling", runner_module.build_sampling_metadata
    )
    build = runner_module.AttentionMetadata.build
    runner_module.AttentionMetadata.build = timer.wrap("attn metadata", build)  # type: ignore[method-assign]
    runner.model.forward = timer.wrap("forward", runner.model.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = timer.wrap("logits", runner.model.compute_logits)  # type: ignore[method-assign]
    runner.sampler = timer.wrap("sampling", runner.sampler)  # type: ignore[assignment]

    def step() -> float:
        t0 = time.perf_counter()
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute_model(out))
        return time.perf_counter() - t0

    step()  # the prefill
    for _ in range(warmup):
        step()
    bandwidth = ReadBandwidth()
    weights = weight_bytes_per_step(runner.model)
    timer.steps.clear()
    timer.current.clear()
    rounds = []  # (GB/s just before, the round's median step in ms)
    for r in range(args.bandwidth_rounds):
        gbs = bandwidth.measure()
        first = len(timer.steps)
        for _ in range(args.steps * (r + 1) // args.bandwidth_rounds - first):
            timer.end_step(step())
        rounds.append((gbs, statistics.median(s["total"] for s in timer.steps[first:]) * 1e3))
    phases = {
        name: statistics.median(s.get(name, 0.0) for s in timer.steps) * 1e3
        for name in ("inputs", "attn metadata", "forward", "logits", "sampling", "other", "total")
    }

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    profiled_total = sum(e.self_cpu_time_total for e in events)
    ops = [
        {
            "op": e.key,
            "calls_per_step": e.count / args.profile_steps,
            "ms_per_step": e.self_cpu_time_total / args.profile_steps / 1e3,
            "share": e.self_cpu_time_total / profiled_total,
        }
        for e in events[: args.top]
    ]
    calls = sum(e.count for e in events) / args.profile_steps
    cold_warm = cold_and_warm(step, runner, runner_module, steps=HOST_STEPS)

    def floor_at(gbs: float) -> float:
        """ms to stream the weights at ``gbs``."""
        return weights / (gbs * 1e9) * 1e3

    best_gbs = max(gbs for gbs, _ in rounds)
    floor_ms = floor_at(best_gbs)
    over_floor = statistics.median(ms / floor_at(gbs) for gbs, ms in rounds)
    load = os.getloadavg()
    result = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "load_avg_1m": round(load[0], 2),
        "dtype": str(runner.dtype),
        "kv_cache_dtype": str(getattr(runner, "kv_cache_dtype", runner.dtype)),
        "context": f"{args.prompt + warmup}..{args.prompt + warmup + args.steps}",
        "phases_ms_median": {k: round(v, 3) for k, v in phases.items()},
        "weight_mb_per_step": round(weights / 1e6, 1),
        "rounds": [
            {"read_bandwidth_gbs": round(g, 2), "step_ms": round(ms, 3)} for g, ms in rounds
        ],
        "step_over_floor": round(over_floor, 2),
        "best_read_bandwidth_gbs": round(best_gbs, 2),
        "weight_stream_floor_ms_at_best": round(floor_ms, 2),
        "step_over_floor_at_best": round(phases["total"] / floor_ms, 2),
        "host_us_in_step_and_again": {
            k: [round(a, 1), round(b, 1)] for k, (a, b) in cold_warm.items()
        },
        "profiled_ops_per_step": round(calls, 1),
        "top_ops": ops,
        "command": "python benchmarks/kernels/step_breakdown.py " + " ".join(sys.argv[1:]),
    }
    print(f"CPU: {result['cpu']}, {args.threads} threads, load {load[0]:.2f}")
    print(f"dtype {result['dtype']}, KV cache {result['kv_cache_dtype']}, ctx {result['context']}")
    print("\nphase              ms/step (median)")
    for name, ms in phases.items():
        print(f"  {name:16s} {ms:8.3f}")
    print(f"\nweights read per step {weights / 1e6:.1f} MB; rounds (read GB/s, step ms):")
    print("  " + ", ".join(f"({gbs:.1f}, {ms:.2f})" for gbs, ms in rounds))
    print(
        f"step = {over_floor:.2f}x the floor of its round (median); "
        f"{phases['total'] / floor_ms:.2f}x the floor at the best {best_gbs:.1f} GB/s "
        f"({floor_ms:.2f} ms)"
    )
    print(f"\nops under the profiler: {calls:.0f} per step; top by self CPU time:")
    for op in ops:
        print(
            f"  {op['op'][:40]:40s} {op['calls_per_step']:7.1f} calls "
            f"{op['ms_per_step']:8.3f} ms {op['share']:6.1%}"
        )
    print("\nhost pieces at their place in a step / called again right after (us):")
    for name, (in_step, again) in cold_warm.items():
        print(f"  {name:16s} {in_step:8.1f} / {again:.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def cold_and_warm(
    step: Callable[[], float], runner: Any, runner_module: Any, steps: int
) -> dict[str, tuple[float, float]]:
    """us of host pieces of a step at their place in it, on caches that the
    weights streaming through have just emptied, and called again right after
    on warm ones: medians over ``steps`` steps."""
    times: dict[str, list[tuple[float, float]]] = {"sampling metadata": [], "embedding": []}

    def twice(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            t1 = time.perf_counter()
            out = fn(*args, **kwargs)
            times[name].append((t1 - t0, time.perf_counter() - t1))
            return out

        return run

    metadata, embed = runner_module.build_sampling_metadata, runner.model.embed
    runner_module.build_sampling_metadata = twice("sampling metadata", metadata)
    runner.model.embed = twice("embedding", embed)
    try:
        for _ in range(steps):
            step()
    finally:
        runner_module.build_sampling_metadata, runner.model.embed = metadata, embed
    return {
        name: (
            statistics.median(a for a, _ in pairs) * 1e6,
            statistics.median(b for _, b in pairs) * 1e6,
        )
        for name, pairs in times.items()
    }


def host_time(args: argparse.Namespace) -> None:
    """Host ms per decode step outside the model, synchronous against async
    scheduling, in ABBA rounds (see the module's docstring)."""
    import torch

    torch.set_num_threads(args.threads)
    from _common import cpu_model

    from tokenloom import LLM, SamplingParams

    engines = {
        mode: LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=args.prompt + args.steps + 64,
            max_num_seqs=8,
            async_scheduling=mode == "async",
            log_stats=False,
        )
        for mode in ("sync", "async")
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    vocab = engines["sync"].client.core.runner.arch.vocab_size
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}

    def run(mode: str, variant: int) -> None:
        llm = engines[mode]
        prompt = [(7 * i + 100 + variant) % vocab for i in range(args.prompt)]
        model = llm.client.core.runner.model
        with clock_engine(llm) as timer:
            model.forward = timer.wrap("forward", model.forward)
            model.compute_logits = timer.wrap("logits", model.compute_logits)
            try:
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                wall = time.perf_counter() - start
            finally:
                del model.forward, model.compute_logits
        phases = per_step_ms(timer, wall)
        steps = phases["steps"]
        model_ms = (timer.current["forward"] + timer.current["logits"]) / steps * 1e3
        phases["model"] = model_ms
        phases["host_outside_model"] = phases["wall"] - model_ms
        runs[mode].append(phases)

    for mode in engines:  # warm-up
        run(mode, 0)
        runs[mode].clear()
    for r in range(args.rounds):
        for mode in ("sync", "async", "async", "sync"):
            run(mode, 1 + r)
    keys = ("wall", "model", "host_outside_model", *PHASES_SHOWN)
    summary = {
        mode: {k: round(statistics.median(p[k] for p in phases), 4) for k in keys}
        for mode, phases in runs.items()
    }
    load = os.getloadavg()
    print(f"CPU: {cpu_model()}, {args.threads} threads, load {load[0]:.2f}")
    print(f"one request, {args.prompt}-token prompt, {args.steps} steps; ABBA x {args.rounds}")
    print(f"\n{'ms per step (median of rounds)':32s} {'sync':>9s} {'async':>9s}")
    for k in keys:
        print(f"  {k:30s} {summary['sync'][k]:9.4f} {summary['async'][k]:9.4f}")
    if args.json:
        result = {
            "cpu": cpu_model(),
            "threads": args.threads,
            "load_avg_1m": round(load[0], 2),
            "ms_per_step": summary,
            "command": "python benchmarks/kernels/step_breakdown.py " + " ".join(sys.argv[1:]),
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


PHASES_SHOWN = ("schedule", "launch", "wait", "update", "outputs", "other")

if __name__ == "__main__":
    main()
