"""One tenant floods the server; how long does another tenant wait for its first token?

Tenant A sends ``--flood`` long requests at once; tenant B sends ``--steady``
short ones at a steady rate from ``--steady-start`` seconds later. B's time to
first token (TTFT, streamed) is measured under each scheduling policy, beside
B alone on an idle server, with the total throughput (prompt and generated
tokens of both tenants over the run's wall time).

One server per policy (``fcfs``, ``priority``, ``fair``), all started at once
with the same flags and a tenants file giving A and B one key each and weight
1; under ``priority`` A's requests carry priority 1 and B's 0 (B first, as an
operator would mark them). Each repeat runs B alone, then the contended
workload on every server, in an order that alternates between repeats
(ABC, CBA, ...), so that all see the same swings of a shared machine. Every
request has its own random token ids (no prefix cache hits), ``ignore_eos``
and a fixed output length. Reports the median over ``--repeats`` of each
figure, and the CPU time other processes used during each run.

``--tiny`` serves a small random Llama (2 layers, hidden size 128, the default
model's tokenizer) written into ``--workdir``: a step then costs about what
the scheduler and the batch's bookkeeping cost, so a busy shared machine
still gets through the flood in minutes, and the figures show the queueing,
not the matrix products.

A request that arrives while a step runs waits for it, so the servers' step
budget (``--max-num-batched-tokens`` in ``--serve-args``) bounds B's wait
beside the flood; run it at two budgets to see what a smaller one costs:

    .venv/bin/python benchmarks/serving/tenant_fairness.py --repeats 3
    .venv/bin/python benchmarks/serving/tenant_fairness.py --repeats 3 --serve-args \
        "--max-num-seqs 32 --max-num-batched-tokens 128 --num-blocks 1024 --max-model-len 512"
    .venv/bin/python benchmarks/serving/tenant_fairness.py --repeats 3 --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import CpuMonitor, cpu_model, serving, tokenloom_serve_cmd  # noqa: E402

POLICIES = ("fcfs", "priority", "fair")
KEYS = {"A": "sk-bench-a", "B": "sk-bench-b"}
PRIORITY = {"A": 1, "B": 0}  # used by the priority policy only


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(
    client: httpx.AsyncClient, tenant: str, prompt: list[int], max_tokens: int
) -> dict[str, float]:
    """A streamed completion; its TTFT, end time and token counts."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": PRIORITY[tenant],
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    start = time.perf_counter()
    ttft = None
    usage: dict[str, int] = {}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{tenant}: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert ttft is not None, "no token came back"
    return {
        "ttft": ttft,
        "end": time.perf_counter(),
        "tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


async def run_workload(
    base_url: str, args: argparse.Namespace, seed: int, flood: bool
) -> dict[str, Any]:
    """B's steady requests, with A's flood beside them unless ``flood`` is off."""
    rng = random.Random(seed)
    a_prompts = prompts(rng, args.flood, args.flood_prompt) if flood else []
    b_prompts = prompts(rng, args.steady, args.steady_prompt)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(3600.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def steady() -> list[dict[str, float]]:
            tasks = []
            for i, prompt in enumerate(b_prompts):
                delay = start + args.steady_start + i * args.steady_interval - time.perf_counter()
                await asyncio.sleep(max(0.0, delay))
                tasks.append(
                    asyncio.create_task(one_request(client, "B", prompt, args.steady_output))
                )
            return list(await asyncio.gather(*tasks))

        flood_tasks = [
            asyncio.create_task(one_request(client, "A", p, args.flood_output)) for p in a_prompts
        ]
        b_results = await steady()
        a_results = list(await asyncio.gather(*flood_tasks))
    end = max(r["end"] for r in a_results + b_results)
    tokens = sum(r["tokens"] for r in a_results + b_results)
    b_ttft = [r["ttft"] for r in b_results]
    return {
        "b_ttft": b_ttft,
        "b_ttft_p50": percentile(b_ttft, 50),
        "b_ttft_p99": percentile(b_ttft, 99),
        "wall_s": end - start,
        "tokens": tokens,
        "throughput": tokens / (end - start),
    }


def measure(base_url: str, args: argparse.Namespace, seed: int, flood: bool) -> dict[str, Any]:
    with CpuMonitor() as monitor:
        result = asyncio.run(run_workload(base_url, args, seed, flood))
    result["other_cpu_s"] = monitor.other_cpu_s
    result["load_avg"] = os.getloadavg()[0]
    return result


def write_tiny_model(out: Path) -> Path:
    """A small random Llama with the default model's tokenizer, in ``out`` (kept)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tokenloom.default_model import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def write_tenants(path: Path) -> None:
    path.write_text(
        json.dumps(
            {"tenants": [{"name": t, "api_keys": [key], "weight": 1} for t, key in KEYS.items()]}
        )
    )


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    keys = ("b_ttft_p50", "b_ttft_p99", "throughput", "wall_s", "other_cpu_s", "load_avg")
    return {
        name: {key: statistics.median(r[key] for r in results) for key in keys}
        for name, results in runs.items()
    }


def table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    alone = summary["alone"]
    fcfs = summary["fcfs"]["throughput"]
    lines = [
        f"A: {args.flood} requests of {args.flood_prompt} prompt + {args.flood_output} output "
        f"tokens at once; B: {args.steady} requests of {args.steady_prompt} + "
        f"{args.steady_output} tokens, one every {args.steady_interval} s from "
        f"{args.steady_start} s. Server: `{args.serve_args}`. Medians of {args.repeats}.",
        "",
        "| policy | B TTFT p50 (s) | B TTFT p99 (s) | p99 / alone | throughput (tok/s) "
        "| / fcfs | run (s) | others' CPU (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| B alone | {alone['b_ttft_p50']:.3f} | {alone['b_ttft_p99']:.3f} | 1.0 | "
        f"{alone['throughput']:.0f} | | {alone['wall_s']:.0f} | {alone['other_cpu_s']:.0f} |",
    ]
    for policy in POLICIES:
        s = summary[policy]
        lines.append(
            f"| {policy} | {s['b_ttft_p50']:.3f} | {s['b_ttft_p99']:.3f} | "
            f"{s['b_ttft_p99'] / alone['b_ttft_p99']:.1f} | {s['throughput']:.0f} | "
            f"{s['throughput'] / fcfs:.3f} | {s['wall_s']:.0f} | {s['other_cpu_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flood", type=int, default=256, help="A's requests, all at once")
    ap.add_argument("--flood-prompt", type=int, default=192)
    ap.add_argument("--flood-output", type=int, default=48)
    ap.add_argument("--steady", type=int, default=16, help="B's requests")
    ap.add_argument("--steady-prompt", type=int, default=64)
    ap.add_argument("--steady-output", type=int, default=8)
    ap.add_argument("--steady-interval", type=float, default=2.0, help="seconds between B's")
    ap.add_argument("--steady-start", type=float, default=3.0, help="B's first, after A's")
    ap.add_argument(
        "--serve-args",
        default="--max-num-seqs 32 --max-num-batched-tokens 256 --num-blocks 1024 "
        "--max-model-len 512",
        help="extra `tokenloom serve` arguments, the same for every policy",
    )
    ap.add_argument("--tiny", action="store_true", help="serve a small random model")
    ap.add_argument("--port", type=int, default=8140, help="first of three ports")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "tenant-fairness")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    tenants = args.workdir / "tenants.json"
    write_tenants(tenants)
    if args.tiny:
        args.serve_args += f" --model {write_tiny_model(args.workdir / 'tiny-model')}"

    urls = {p: f"http://127.0.0.1:{args.port + i}" for i, p in enumerate(POLICIES)}
    for url in urls.values():  # a stale server there would answer for ours
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
            raise SystemExit(f"something already serves {url}: pick other ports (--port)")
    # Stopped by a signal, still stop the servers (the ExitStack's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], **{p: [] for p in POLICIES}}
    with contextlib.ExitStack() as stack:
        for i, policy in enumerate(POLICIES):
            extra = f"{args.serve_args} --policy {policy} --tenants {tenants}"
            cmd = tokenloom_serve_cmd(args.port + i, extra)
            stack.enter_context(
                serving(cmd, urls[policy], args.workdir / f"server-{policy}.log", ROOT, 600)
            )
        for url in urls.values():  # warm-up: every server runs a little of both
            measure(url, argparse.Namespace(**{**vars(args), "flood": 8, "steady": 2}), 99, True)
        for rep in range(args.repeats):
            order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
            runs["alone"].append(measure(urls[order[0]], args, seed=rep, flood=False))
            print(f"repeat {rep + 1}: alone p99 {runs['alone'][-1]['b_ttft_p99']:.3f}s", flush=True)
            for policy in order:
                runs[policy].append(measure(urls[policy], args, seed=rep, flood=True))
                r = runs[policy][-1]
                print(
                    f"repeat {rep + 1}: {policy} B p50 {r['b_ttft_p50']:.3f}s "
                    f"p99 {r['b_ttft_p99']:.3f}s, {r['throughput']:.0f} tok/s, "
                    f"{r['wall_s']:.0f}s, others' CPU {r['other_cpu_s']:.0f}s",
                    flush=True,
                )
    summary = summarize(runs)
    result = {
        "command": "python benchmarks/serving/tenant_fairness.py " + shlex.join(sys.argv[1:]),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "summary": summary,
        "runs": runs,
    }
    (args.workdir / "result.json").write_text(json.dumps(result, indent=2))
    text = table(summary, args)
    (args.workdir / "result.md").write_text(text)
    print(result["command"])
    print(text)


if __name__ == "__main__":
    main()
