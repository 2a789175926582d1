"""KV connectors over HTTP: the disk tier's TTFT, and prefill/decode disaggregation.

Disk tier: a shared document of ``--doc-tokens`` tokens followed by short
questions, on servers whose in-memory cache (``--num-blocks``) holds one such
request but not two, so a request on another document in between evicts it.
Per round, side by side: the TTFT of a question after that eviction without a
connector (the document is recomputed) and with the disk tier
(``--kv-offload-dir``: it is loaded), the TTFT of a warm in-memory hit (the
question right after the document), and the TTFT of the first question after
the tier's server is restarted. Rounds alternate the order of the servers.

Hit paths (``hit_paths``): in one process, no HTTP, alternating ABBA over
``--hit-rounds``, the TTFT of a question on the document when it is in memory
(a warm prefix hit) and when only the disk tier holds it.

Disaggregation: a single engine against a prefill engine (``kv_producer``) and
a decode engine (``kv_consumer``) behind ``tokenloom disagg-proxy``, at each
``--concurrencies`` value: TTFT and TPOT per request (medians over the rounds'
medians), greedy outputs compared with the single engine's, and the prompt
tokens the decode engine computed itself (from its /metrics).

Medians of ``--rounds``; everything runs on this machine, so compare the
figures within one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import report, serving, tokenloom_serve_cmd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    "What is this document about?",
    "Summarise the second paragraph.",
    "Which functions does it name?",
    "What would a beginner find hard here?",
    "Give one example it does not give.",
    "Which errors can occur?",
    "What is the default behaviour?",
    "Who is this written for?",
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A running ``tokenloom serve`` (or proxy) and its base URL."""

    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, url


@contextlib.contextmanager
def serve(name: str, args: str, logs: Path) -> Iterator[Server]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serving(tokenloom_serve_cmd(port, args), url, logs / f"{name}.log", ROOT):
        yield Server(name, url)


@contextlib.contextmanager
def proxy(prefill: Server, decode: Server, logs: Path) -> Iterator[Server]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "tokenloom.entrypoints.cli", "disagg-proxy",
        "--prefill", prefill.url, "--decode", decode.url, "--port", str(port),
    ]  # fmt: skip
    with serving(cmd, url, logs / "proxy.log", ROOT):
        yield Server("proxy", url)


async def stream(
    client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One greedy streamed completion: TTFT, TPOT and the text."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    times: list[float] = []
    text = ""
    async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                if choice.get("text"):
                    times.append(time.perf_counter())
                    text += choice["text"]
    ttft = times[0] - started
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "text": text}


async def tokenize(client: httpx.AsyncClient, server: Server, text: str) -> list[int]:
    r = await client.post(
        server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
    )
    r.raise_for_status()
    return list(r.json()["tokens"])


def prose() -> Iterator[str]:
    """English prose: the standard library's docstrings, a module at a time."""
    import importlib

    for name in ("json", "argparse", "csv", "logging", "socket", "inspect", "collections"):
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        docs += [inspect.getdoc(member) or "" for _, member in inspect.getmembers(module)]
        yield "\n".join(docs)


async def text_pool(client: httpx.AsyncClient, server: Server, size: int) -> list[int]:
    """At least ``size`` token ids of prose."""
    pool: list[int] = []
    for text in prose():
        pool += await tokenize(client, server, text)
        if len(pool) >= size:
            return pool
    raise RuntimeError(f"only {len(pool)} tokens of text, {size} wanted")


def documents(pool: list[int], count: int, length: int, salt: int = 0) -> list[list[int]]:
    """``count`` documents of ``length`` tokens, distinct from the first token on (the
    prefix cache and the disk tier key on the whole chain of blocks)."""
    out = []
    for i in range(count):
        start = ((salt * count + i) * 7919) % (len(pool) - length)
        out.append([1000 + salt * count + i, *pool[start : start + length - 1]])
    return out


def prompt_tokens_computed(metrics_text: str) -> float:
    """Prompt tokens an engine computed itself: looked up, minus in-memory and connector hits."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return (
        values.get("tokenloom:prefix_cache_queries_total", 0.0)
        - values.get("tokenloom:prefix_cache_hits_total", 0.0)
        - values.get("tokenloom:external_prefix_cache_hits_total", 0.0)
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def disk_tier(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    tier = Path(tempfile.mkdtemp(prefix="kv_tier_", dir=logs))
    try:
        return await _disk_tier(args, logs, tier)
    finally:
        shutil.rmtree(tier, ignore_errors=True)


async def _disk_tier(args: argparse.Namespace, logs: Path, tier: Path) -> dict[str, Any]:
    common = (
        f"{args.serve_args} --num-blocks {args.num_blocks} --max-model-len {args.doc_tokens + 128}"
    )
    with_tier = f"{common} --kv-offload-dir {tier} --kv-offload-bytes {args.offload_bytes}"
    ttft: dict[str, list[float]] = {"none": [], "disk_tier": [], "warm": [], "restart": []}
    async with httpx.AsyncClient(timeout=600) as client:
        with serve("no_connector", common, logs) as plain:
            pool = await text_pool(client, plain, 2 * args.doc_tokens)
            document, other = documents(pool, 2, args.doc_tokens)
            question = [await tokenize(client, plain, "\nQ: " + q + "\nA:") for q in QUESTIONS]
            for r in range(args.rounds):
                with serve(f"disk_tier_{r}", with_tier, logs) as tiered:
                    if r > 0:
                        # A fresh process on last round's tier: nothing in memory yet
                        # (one short request first, so the TTFT is not a cold start's).
                        await stream(client, tiered, question[5], 1)
                        out = await stream(client, tiered, document + question[0], args.max_tokens)
                        ttft["restart"].append(out["ttft"])
                    servers = [plain, tiered] if r % 2 == 0 else [tiered, plain]
                    for server in servers:
                        await stream(client, server, document + question[1], args.max_tokens)
                    # A warm in-memory hit: the same document right after.
                    out = await stream(client, plain, document + question[2], args.max_tokens)
                    ttft["warm"].append(out["ttft"])
                    # Another document evicts the first from memory on both servers.
                    for server in servers:
                        await stream(client, server, other + question[3], 1)
                    for server in servers:
                        out = await stream(client, server, document + question[4], args.max_tokens)
                        ttft["none" if server is plain else "disk_tier"].append(out["ttft"])
                    metrics = (await client.get(tiered.url + "/metrics")).text
            # The last round's tier after one more restart (3 restarts for 3 rounds).
            with serve("disk_tier_restart", with_tier, logs) as tiered:
                await stream(client, tiered, question[5], 1)
                out = await stream(client, tiered, document + question[0], args.max_tokens)
                ttft["restart"].append(out["ttft"])
    hits = [
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "tokenloom:external_prefix_cache_hits_total"
    ]
    medians = {k: median(v) for k, v in ttft.items()}
    return {
        "doc_tokens": args.doc_tokens,
        "num_blocks": args.num_blocks,
        "ttft_s": ttft,
        "ttft_median_s": medians,
        "speedup_disk_tier_vs_none": medians["none"] / medians["disk_tier"],
        "restart_vs_warm": medians["restart"] / medians["warm"],
        "tier_hit_tokens_last_server": sum(hits),
    }


def hit_paths(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """In one process (an ``LLM``, no HTTP), alternating ABBA: the TTFT of a question
    on the document held in memory (a warm prefix hit) and held only by the disk
    tier (the in-memory cache reset first, so its blocks are loaded)."""
    from tokenloom import LLM, SamplingParams

    tier = Path(tempfile.mkdtemp(prefix="kv_tier_", dir=logs))
    llm = LLM(
        kv_offload_dir=str(tier),
        num_blocks=args.num_blocks,
        max_model_len=args.doc_tokens + 128,
        max_num_batched_tokens=2048,
        log_stats=False,
    )
    try:
        tokenizer = llm.get_tokenizer()
        pool: list[int] = []
        for text in prose():
            pool += tokenizer.encode(text, add_special_tokens=False)
            if len(pool) >= args.doc_tokens:
                break
        (document,) = documents(pool, 1, args.doc_tokens)
        questions = iter(
            [tokenizer.encode(f"\nQ: {q}\nA:", add_special_tokens=False) for q in QUESTIONS]
            * (4 * args.hit_rounds + 2)
        )
        first_token = SamplingParams(max_tokens=1, temperature=0.0)

        def ttft(where: str) -> float:
            if where == "disk":
                assert llm.reset_prefix_cache()
            started = time.perf_counter()
            (out,) = llm.generate([document + next(questions)], first_token, use_tqdm=False)
            elapsed = time.perf_counter() - started
            if out.num_cached_tokens < args.doc_tokens // 16 * 16:
                raise RuntimeError(f"{where}: only {out.num_cached_tokens} tokens cached")
            return elapsed

        llm.generate([document + next(questions)], first_token, use_tqdm=False)
        deadline = time.monotonic() + 120
        while sum(1 for _ in tier.glob("blocks/*/*")) < args.doc_tokens // 16:
            if time.monotonic() > deadline:
                raise RuntimeError("the document's blocks did not reach the disk")
            time.sleep(0.1)
        ttft("warm")  # a step, so the tier's index learns of the last saves
        times: dict[str, list[float]] = {"warm": [], "disk": []}
        for r in range(args.hit_rounds):
            for where in ("warm", "disk", "disk", "warm")[:: 1 if r % 2 == 0 else -1]:
                times[where].append(ttft(where))
    finally:
        llm.client.shutdown()
        shutil.rmtree(tier, ignore_errors=True)
    medians = {k: median(v) for k, v in times.items()}
    return {
        "doc_tokens": args.doc_tokens,
        "ttft_s": times,
        "ttft_median_s": medians,
        "disk_vs_warm": medians["disk"] / medians["warm"],
    }


async def run_batch(
    client: httpx.AsyncClient,
    server: Server,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> dict[str, Any]:
        async with semaphore:
            return await stream(client, server, prompt, max_tokens)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def disaggregation(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    kv_port = free_port()
    producer = json.dumps(
        {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port}
    )
    consumer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_consumer"})
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        with (
            serve("single", args.serve_args, logs) as single,
            serve("prefill", f"{args.serve_args} --kv-transfer-config '{producer}'", logs) as pre,
            serve("decode", f"{args.serve_args} --kv-transfer-config '{consumer}'", logs) as dec,
            proxy(pre, dec, logs) as front,
        ):
            pool = await text_pool(client, single, 4 * args.prompt_tokens)
            salt = 0
            for concurrency in args.concurrencies:
                runs: dict[str, dict[str, list[float]]] = {
                    name: {"ttft": [], "tpot": []} for name in ("single", "disaggregated")
                }
                identical = True
                before = prompt_tokens_computed((await client.get(dec.url + "/metrics")).text)
                num_requests = 0
                for r in range(args.rounds):
                    # Fresh prompts each round, so no prefix cache serves them.
                    salt += 1
                    prompts = documents(pool, max(concurrency, 4), args.prompt_tokens, salt)
                    order = [single, front] if r % 2 == 0 else [front, single]
                    outs = {}
                    for server in order:
                        outs[server.name] = await run_batch(
                            client, server, prompts, concurrency, args.decode_tokens
                        )
                        if server is front:
                            num_requests += len(prompts)
                    identical &= [o["text"] for o in outs["single"]] == [
                        o["text"] for o in outs["proxy"]
                    ]
                    for name, key in (("single", "single"), ("disaggregated", "proxy")):
                        runs[name]["ttft"].append(median([o["ttft"] for o in outs[key]]))
                        runs[name]["tpot"].append(median([o["tpot"] for o in outs[key]]))
                after = prompt_tokens_computed((await client.get(dec.url + "/metrics")).text)
                results[f"concurrency_{concurrency}"] = {
                    "requests_per_round": max(concurrency, 4),
                    "rounds": runs,
                    "median_ttft_s": {k: median(v["ttft"]) for k, v in runs.items()},
                    "median_tpot_s": {k: median(v["tpot"]) for k, v in runs.items()},
                    "outputs_identical": identical,
                    "decode_engine_prompt_tokens_computed_per_request": (after - before)
                    / num_requests,
                }
    return {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="disk_tier,hit_paths,disaggregation")
    parser.add_argument("--serve-args", default="--max-num-batched-tokens 2048")
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--num-blocks", type=int, default=300)
    parser.add_argument("--offload-bytes", type=int, default=2**30)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hit-rounds", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logs = ROOT / ".bench" / "kv_connectors"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"rounds": args.rounds}
    parts = args.parts.split(",")
    if "disk_tier" in parts:
        result["disk_tier"] = asyncio.run(disk_tier(args, logs))
    if "hit_paths" in parts:
        result["hit_paths"] = hit_paths(args, logs)
    if "disaggregation" in parts:
        result["disaggregation"] = asyncio.run(disaggregation(args, logs))
    report(result, "benchmarks/features/kv_connectors.py", args.json)


if __name__ == "__main__":
    main()
