"""Speculative decoding benchmark: TPOT and output tokens/s, n-gram speculation on/off.

Two workloads, each run at several concurrencies (``max_num_seqs``; every run
submits its requests at once, so the engine keeps that many in flight):

* ``grounded``: input-grounded prompts whose answers repeat text of the prompt
  (copy, lowercase, reformat as a list, extract sentences), built from the
  docstrings of Python standard-library modules (local text, the same on every
  machine with the same Python), chat template applied, greedy, natural stops.
* ``main``: the peers benchmark's free-generation workload (random token-id
  prompts, log-uniform lengths, greedy with ``ignore_eos``), scaled down to
  prompts of 16-128 tokens and outputs of 16 to ``--max-tokens``.

Both engines (speculation off and on) live in one process, loaded once; for
each (workload, concurrency) they run back to back, ``--repeats`` times,
alternating (so both see the same machine), prefix cache reset before each
run, and the medians are reported. Concurrency ``c`` submits ``c`` requests at
once. TPOT is per request (decode time
over the tokens after the first, from the engine's own request stats),
averaged over requests; output tok/s is all output tokens over the run's wall
time. Greedy outputs are checked to be identical with speculation on and off.
The CPU and the 1-minute load average before and after each row are recorded
(the machine may be shared).

    python benchmarks/features/spec_decode.py --concurrency 1,4,16,64 --repeats 3 --out .bench/spec_decode.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import cpu_model  # noqa: E402  (stdlib-only helpers of the benchmarks)

TASKS = (
    "Copy the following passage exactly, word for word.\n\n{passage}",
    "Rewrite the following passage in lowercase letters, keeping every word.\n\n{passage}",
    "Reformat the following passage as a bulleted list with one sentence per bullet.\n\n{passage}",
    "Repeat the sentences of the following passage that mention '{word}'.\n\n{passage}",
)
# The peers benchmark's main workload draws prompts of 32-512 tokens; this one is
# scaled down (prompt and output lengths) so the whole run fits a shared 2-core VM.
MAIN_PROMPT_MAX = 128
SOURCE_MODULES = (
    "json", "textwrap", "collections", "argparse", "logging", "heapq", "bisect", "csv",
    "shutil", "tempfile", "statistics", "fractions", "decimal", "difflib", "string", "zipfile",
)  # fmt: skip


def passages(max_words: int = 45) -> list[str]:
    """Paragraph-sized passages from standard-library module docstrings."""
    result = []
    for name in SOURCE_MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        for paragraph in doc.split("\n\n"):
            words = paragraph.split()
            if len(words) >= 25 and not paragraph.lstrip().startswith((">>>", "-", "*")):
                result.append(" ".join(words[:max_words]))
    return result


def grounded_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = passages()
    prompts = []
    for i in range(count):
        passage = texts[(i * 7 + seed) % len(texts)]
        word = rng.choice([w for w in passage.split() if len(w) > 4] or ["the"]).strip(".,:;()")
        content = TASKS[i % len(TASKS)].format(passage=passage, word=word)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        prompts.append([int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]])
    return prompts


def build_workload(
    name: str, tokenizer: Any, count: int, seed: int, max_tokens: int, prompt_max: int
) -> dict:
    from tokenloom.bench.datasets import LengthSpec, random_requests, tokenizer_vocab

    if name == "grounded":
        prompts = grounded_prompts(tokenizer, count, seed)
        return {"prompts": prompts, "max_tokens": [max_tokens] * count, "ignore_eos": False}
    requests = random_requests(
        count,
        LengthSpec("log-uniform", 16, prompt_max),
        LengthSpec("log-uniform", 16, max_tokens),
        tokenizer_vocab(tokenizer),
        seed,
    )
    return {
        "prompts": [r.prompt_token_ids for r in requests],
        "max_tokens": [r.max_tokens for r in requests],
        "ignore_eos": True,
    }


class Collector:
    """A stat logger keeping finished-request stats and draft acceptance."""

    def __init__(self) -> None:
        from tokenloom.metrics.spec_decode import SpecDecodingSummary

        self.finished: list[Any] = []
        self.spec = SpecDecodingSummary()

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if iteration_stats is not None:
            self.finished.extend(iteration_stats.finished_requests)
        if scheduler_stats is not None:
            self.spec.add(scheduler_stats.spec_decoding_stats)


def run_once(llm: Any, workload: dict, count: int) -> dict:
    """The workload's first ``count`` requests, all at once (so ``count`` run
    concurrently)."""
    from tokenloom import SamplingParams

    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=workload["ignore_eos"])
        for m in workload["max_tokens"]
    ]
    llm.reset_prefix_cache()
    collector = Collector()
    llm.stat_loggers = [collector]
    started = time.perf_counter()
    outputs = llm.generate(workload["prompts"][:count], params[:count], use_tqdm=False)
    wall = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    tpots = [
        f.decode_time / (f.num_generation_tokens - 1)
        for f in collector.finished
        if f.num_generation_tokens > 1
    ]
    num_out = sum(len(t) for t in tokens)
    return {
        "wall_s": wall,
        "output_tokens": num_out,
        "output_tok_s": num_out / wall,
        "tpot_ms": 1000 * statistics.mean(tpots) if tpots else math.nan,
        "acceptance_rate": collector.spec.acceptance_rate,
        "mean_acceptance_length": collector.spec.mean_acceptance_length,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="grounded,main")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--main-prompt-max", type=int, default=MAIN_PROMPT_MAX, help="main: longest prompt"
    )
    parser.add_argument("--num-blocks", type=int, default=1600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from tokenloom import LLM, SamplingParams

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    common = {"max_num_seqs": max(concurrencies), "num_blocks": args.num_blocks, "log_stats": False}
    started = time.perf_counter()
    engines = {
        "off": LLM(**common),
        "ngram": LLM(**common, speculative_config=json.loads(args.speculative_config)),
    }
    print(f"engines loaded in {time.perf_counter() - started:.0f}s", flush=True)
    tokenizer = engines["off"].get_tokenizer()
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    for llm in engines.values():
        llm.generate([[1, 2, 3, 4] * 8, [5, 6, 7] * 10], warm, use_tqdm=False)

    rows = []
    for workload_name in args.workloads.split(","):
        workload = build_workload(
            workload_name,
            tokenizer,
            max(max(concurrencies), 2),
            args.seed,
            args.max_tokens,
            args.main_prompt_max,
        )
        for concurrency in concurrencies:
            load_before = os.getloadavg()[0]
            runs: dict[str, list[dict]] = {"off": [], "ngram": []}
            for _ in range(args.repeats):
                for label, llm in engines.items():
                    runs[label].append(run_once(llm, workload, concurrency))
            reference = runs["off"][0]["tokens"]
            identical = all(r["tokens"] == reference for r in runs["ngram"] + runs["off"])
            row: dict[str, Any] = {
                "workload": workload_name,
                "concurrency": concurrency,
                "identical": identical,
                "output_tokens": runs["off"][0]["output_tokens"],
                "load_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            }
            for label, label_runs in runs.items():
                for key in ("tpot_ms", "output_tok_s", "wall_s"):
                    row[f"{label}_{key}"] = statistics.median(r[key] for r in label_runs)
                    row[f"{label}_{key}_all"] = [round(r[key], 2) for r in label_runs]
            for key in ("acceptance_rate", "mean_acceptance_length"):
                row[key] = statistics.median(r[key] for r in runs["ngram"])
            rows.append(row)
            print(format_row(row), flush=True)
    print(f"total {time.perf_counter() - started:.0f}s on {cpu_model()}")
    if args.out:
        result = {"cpu": cpu_model(), "total_s": time.perf_counter() - started, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(format_table(rows))


def format_row(row: dict) -> str:
    return (
        f"{row['workload']:>8} c={row['concurrency']:<3} TPOT {row['off_tpot_ms']:.1f} -> "
        f"{row['ngram_tpot_ms']:.1f} ms ({row['off_tpot_ms'] / row['ngram_tpot_ms']:.2f}x), "
        f"tok/s {row['off_output_tok_s']:.1f} -> {row['ngram_output_tok_s']:.1f} "
        f"({row['ngram_output_tok_s'] / row['off_output_tok_s'] - 1:+.1%}), acceptance "
        f"{row['acceptance_rate']:.0%}, mean acceptance length {row['mean_acceptance_length']:.2f}, "
        f"identical={row['identical']}, load {row['load_1m'][0]}-{row['load_1m'][1]}"
    )


def format_table(rows: list[dict]) -> str:
    lines = [
        "| workload | concurrency | TPOT off (ms) | TPOT n-gram (ms) | TPOT ratio | "
        "tok/s off | tok/s n-gram | tok/s change | acceptance rate | mean acceptance length | "
        "identical output | load (1 min) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['off_tpot_ms']:.1f} | "
            f"{r['ngram_tpot_ms']:.1f} | {r['off_tpot_ms'] / r['ngram_tpot_ms']:.2f}x | "
            f"{r['off_output_tok_s']:.1f} | {r['ngram_output_tok_s']:.1f} | "
            f"{r['ngram_output_tok_s'] / r['off_output_tok_s'] - 1:+.1%} | "
            f"{r['acceptance_rate']:.0%} | {r['mean_acceptance_length']:.2f} | {r['identical']} | "
            f"{r['load_1m'][0]}-{r['load_1m'][1]} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
