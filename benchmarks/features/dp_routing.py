"""Data parallel routing: prefix-cache hit rate of prefix-aware vs round robin routing,
and throughput beside one engine core.

Workload: 4 distinct system prompts of ``--system-tokens`` tokens (text of
Python standard-library docstrings, the same on every machine with the same
Python), each followed by ``--requests-per-prompt`` distinct short questions;
the requests arrive interleaved in a seeded random order, all at once (or at
``--request-rate`` per second), greedy, ``--max-tokens`` each. A strictly
cyclic order would hand round robin the same affinity as prefix routing
(prompt i always on core i mod 2), hence the shuffle.

Each configuration (``dp=2`` prefix, ``dp=2`` round robin, ``dp=1``) is a
fresh ``AsyncLLM`` (cores in their own processes), warmed up with one
unrelated request; the hit rate is prefix-cache hit tokens over looked-up
prompt tokens, summed over the cores' scheduler stats. ``--num-blocks`` sets
each core's KV cache: small enough that one core cannot keep all four
prompts' blocks beside its running batch is where routing matters; the
default (sized from memory) holds everything. ``--threads`` CPU threads are
split between the cores.

    python benchmarks/features/dp_routing.py --num-blocks 72 --max-num-seqs 8 --out .bench/dp_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import report  # noqa: E402  (stdlib-only helpers of the benchmarks)

SOURCES = ("argparse", "logging", "json", "csv")
QUESTIONS = (
    "Summarise the module in one sentence.",
    "Which class should a beginner use first?",
    "Name one function and what it returns.",
    "What is a common mistake when using it?",
)


class HitCounter:
    """Sums the cores' prefix cache lookups and generated tokens (a ``StatLogger``)."""

    def __init__(self) -> None:
        self.queries = self.hits = self.generated = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.queries += scheduler_stats.prefix_cache_queries
            self.hits += scheduler_stats.prefix_cache_hits
        if iteration_stats is not None:
            self.generated += iteration_stats.num_generation_tokens


def build_prompts(
    tokenizer: Any, system_tokens: int, per_prompt: int, seed: int
) -> list[list[int]]:
    """``4 * per_prompt`` token-id prompts, interleaved in a seeded random order."""
    systems = []
    for name in SOURCES:
        text = inspect.getdoc(importlib.import_module(name)) or name
        ids = tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < system_tokens:
            ids = ids + ids
        systems.append(ids[:system_tokens])
    prompts = []
    for i in range(per_prompt):
        question = f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"
        tail = tokenizer.encode("\n" + question, add_special_tokens=False)
        prompts += [system + tail for system in systems]
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[i] for i in order]


async def run_config(args: argparse.Namespace, dp: int, policy: str) -> dict[str, Any]:
    from tokenloom.engine.args import EngineArgs
    from tokenloom.engine.async_llm import AsyncLLM
    from tokenloom.sampling_params import SamplingParams

    os.environ["OMP_NUM_THREADS"] = str(max(1, args.threads // dp))  # inherited by the cores
    counter = HitCounter()
    engine_args = EngineArgs(
        data_parallel_size=dp,
        dp_load_balance=policy,
        dp_load_margin=args.load_margin,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.system_tokens + 128,
        dtype=args.dtype,
        log_stats=False,
    )
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[counter])
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

        async def one(request_id: str, prompt: list[int], delay: float) -> list[int]:
            await asyncio.sleep(delay)
            final = None
            async for output in engine.generate(prompt, params, request_id):
                final = output
            assert final is not None
            return list(final.outputs[0].token_ids)

        await one("warmup", [1, 2, 3], 0.0)
        counter.queries = counter.hits = counter.generated = 0
        prompts = build_prompts(engine.tokenizer, args.system_tokens, args.requests_per_prompt, 0)
        gap = 1.0 / args.request_rate if args.request_rate > 0 else 0.0
        started = time.perf_counter()
        outputs = await asyncio.gather(
            *(one(f"r{i}", prompt, i * gap) for i, prompt in enumerate(prompts))
        )
        wall = time.perf_counter() - started
    finally:
        engine.shutdown()
    return {
        "data_parallel_size": dp,
        "policy": policy if dp > 1 else "-",
        "requests": len(prompts),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(prompts) / wall, 3),
        "output_tokens_per_s": round(counter.generated / wall, 2),
        "prefix_cache_queries": counter.queries,
        "prefix_cache_hits": counter.hits,
        "prefix_cache_hit_rate": round(counter.hits / max(counter.queries, 1), 4),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--requests-per-prompt", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=0.0, help="0: all at once")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per core")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--load-margin", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", default="2:prefix,2:round_robin,1:-")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs = []
    for config in args.configs.split(","):
        dp, policy = config.split(":")
        result = asyncio.run(run_config(args, int(dp), "prefix" if policy == "-" else policy))
        print(
            f"dp={dp} {policy}: hit rate {result['prefix_cache_hit_rate']:.1%}, "
            f"{result['requests_per_s']:.2f} req/s, {result['wall_s']:.1f} s",
            file=sys.stderr,
        )
        runs.append(result)
    # Greedy: every configuration must produce the same tokens for the same request.
    reference = runs[0].pop("outputs")
    for run in runs[1:]:
        same = sum(a == b for a, b in zip(run.pop("outputs"), reference, strict=True))
        run["outputs_equal_to_first"] = f"{same}/{len(reference)}"
    by_policy = {(r["data_parallel_size"], r["policy"]): r for r in runs}
    summary: dict[str, Any] = {}
    prefix, rr = by_policy.get((2, "prefix")), by_policy.get((2, "round_robin"))
    if prefix and rr and rr["prefix_cache_hit_rate"]:
        summary["hit_rate_prefix_over_round_robin"] = round(
            prefix["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"], 3
        )
    single = by_policy.get((1, "-"))
    if prefix and single:
        summary["throughput_dp2_prefix_over_dp1"] = round(
            prefix["requests_per_s"] / single["requests_per_s"], 3
        )
    load = os.getloadavg()
    report(
        {
            "benchmark": "dp_routing",
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "runs": runs,
            "summary": summary,
            "loadavg_at_end": [round(x, 2) for x in load],
        },
        "benchmarks/features/dp_routing.py",
        args.out,
    )


if __name__ == "__main__":
    main()
