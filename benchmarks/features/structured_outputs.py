"""Structured outputs: output tok/s of JSON-schema requests against free ones of the same lengths.

Each round sends ``--num-requests`` concurrent chat requests constrained by one
JSON schema (offline ``LLM.chat``, the default model unless ``--model``), then
the same prompts unconstrained with ``ignore_eos`` and each request's
``max_tokens`` set to the length its structured twin produced, so both runs
generate exactly the same number of tokens per request. The prefix cache is
reset before every run. Rounds alternate which run goes first; the table has
the median of ``--repeats`` rounds.

Also measured: the time per step spent filling the grammar bitmask (engine,
matchers) and applying it to the logits (runner), and the grammar compile
counter: the schema is shared by every request, so it is compiled once.

    .venv/bin/python benchmarks/features/structured_outputs.py
    .venv/bin/python benchmarks/features/structured_outputs.py --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cpu_model  # noqa: E402  (stdlib-only helpers of the benchmarks)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}  # fmt: skip


class Timer:
    """Wraps a function and adds up the time spent in it and the number of calls."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        self.inner = getattr(owner, name)
        self.seconds = 0.0
        self.calls = 0
        setattr(owner, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def take(self) -> tuple[float, int]:
        seconds, calls = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return seconds, calls


class GrammarCounter:
    """A stat logger adding up the structured-output counters of SchedulerStats."""

    def __init__(self) -> None:
        self.requests = self.compiles = self.cache_hits = 0
        self.compile_seconds = 0.0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is None:
            return
        self.requests += scheduler_stats.num_structured_requests
        self.cache_hits += scheduler_stats.grammar_cache_hits
        self.compiles += len(scheduler_stats.grammar_compile_times)
        self.compile_seconds += sum(scheduler_stats.grammar_compile_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    import jsonschema
    import torch

    import tokenloom.worker.model_runner as model_runner
    from tokenloom import SamplingParams
    from tokenloom.engine.llm import LLM
    from tokenloom.structured_output import StructuredOutputsParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, log_stats=False)
    counter = GrammarCounter()
    llm.stat_loggers.append(counter)  # type: ignore[arg-type]
    fill = Timer(llm.client.core.structured_output_manager, "grammar_bitmask")
    apply = Timer(model_runner, "apply_grammar_bitmask")

    n = args.num_requests
    conversations = [
        [{"role": "user", "content": f"Make up user record number {i} as JSON."}] for i in range(n)
    ]
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    def structured_params(i: int) -> Any:
        return SamplingParams(
            temperature=args.temperature,
            seed=1000 + i,
            max_tokens=args.max_tokens,
            structured_outputs=constraint,
        )

    def run_structured() -> tuple[float, list[int], int]:
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outs = llm.chat(conversations, [structured_params(i) for i in range(n)], use_tqdm=False)
        elapsed = time.perf_counter() - started
        valid = 0
        for out in outs:
            try:
                jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass  # cut by max_tokens: counted below
        return elapsed, [len(o.outputs[0].token_ids) for o in outs], valid

    def run_free(lengths: list[int]) -> tuple[float, list[int]]:
        llm.reset_prefix_cache()
        params = [
            SamplingParams(
                temperature=args.temperature, seed=1000 + i, max_tokens=length, ignore_eos=True
            )
            for i, length in enumerate(lengths)
        ]
        started = time.perf_counter()
        outs = llm.chat(conversations, params, use_tqdm=False)
        return time.perf_counter() - started, [len(o.outputs[0].token_ids) for o in outs]

    # Warm-up: a few short requests (the schema compiles here, once).
    warm = llm.chat(
        conversations[:4],
        [dataclasses.replace(structured_params(i), max_tokens=8) for i in range(4)],
        use_tqdm=False,
    )
    warm_lengths = [args.max_tokens] * n
    assert all(o.outputs[0].token_ids for o in warm)
    fill.take(), apply.take()

    rounds = []
    for r in range(args.repeats):
        order = ("structured", "free") if r % 2 == 0 else ("free", "structured")
        result: dict[str, Any] = {}
        lengths = warm_lengths
        for which in order:
            if which == "structured":
                fill.take(), apply.take()
                elapsed, lengths_s, valid = run_structured()
                fill_s, fill_calls = fill.take()
                apply_s, apply_calls = apply.take()
                result.update(
                    structured_s=elapsed,
                    structured_tokens=sum(lengths_s),
                    lengths=lengths_s,
                    valid=valid,
                    steps=fill_calls,
                    fill_ms_per_step=1e3 * fill_s / max(fill_calls, 1),
                    apply_ms_per_step=1e3 * apply_s / max(apply_calls, 1),
                    mask_share=(fill_s + apply_s) / elapsed,
                )
                lengths = lengths_s
            else:
                # Same lengths as this round's structured run when it went first,
                # else as the previous round's (seeded sampling: the same lengths).
                elapsed, lengths_f = run_free(result.get("lengths", lengths))
                result.update(free_s=elapsed, free_tokens=sum(lengths_f))
        result["structured_tok_s"] = result["structured_tokens"] / result["structured_s"]
        result["free_tok_s"] = result["free_tokens"] / result["free_s"]
        result["ratio"] = result["structured_tok_s"] / result["free_tok_s"]
        del result["lengths"]
        rounds.append(result)
        print(
            f"round {r + 1}: structured {result['structured_tok_s']:.1f} tok/s "
            f"({result['structured_tokens']} tokens, {result['valid']}/{n} valid), "
            f"free {result['free_tok_s']:.1f} tok/s ({result['free_tokens']} tokens), "
            f"ratio {result['ratio']:.3f}; bitmask fill {result['fill_ms_per_step']:.2f} ms "
            f"+ apply {result['apply_ms_per_step']:.2f} ms per step "
            f"({100 * result['mask_share']:.1f}% of the structured run)",
            flush=True,
        )

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    summary = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "num_requests": n,
        "temperature": args.temperature,
        "structured_tok_s": median("structured_tok_s"),
        "free_tok_s": median("free_tok_s"),
        "ratio": median("ratio"),
        "fill_ms_per_step": median("fill_ms_per_step"),
        "apply_ms_per_step": median("apply_ms_per_step"),
        "mask_share": median("mask_share"),
        "structured_requests": counter.requests,
        "grammar_compiles": counter.compiles,
        "grammar_cache_hits": counter.cache_hits,
        "grammar_compile_ms": 1e3 * counter.compile_seconds,
        "rounds": rounds,
    }
    print(
        f"median of {args.repeats}: structured {summary['structured_tok_s']:.1f} tok/s, "
        f"free {summary['free_tok_s']:.1f} tok/s, ratio {summary['ratio']:.3f}; "
        f"bitmask {summary['fill_ms_per_step']:.2f} ms fill + "
        f"{summary['apply_ms_per_step']:.2f} ms apply per step; "
        f"{counter.requests} structured requests, {counter.compiles} grammar compile(s) "
        f"({summary['grammar_compile_ms']:.1f} ms), {counter.cache_hits} cache hits; CPU {summary['cpu']}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
