"""Async load generator for any OpenAI-compatible ``/v1/completions`` server.

Requests are streamed (server-sent events) so each token's arrival can be
timed. Arrivals follow a Poisson process at ``request_rate`` (``inf`` sends
everything at once), optionally capped at ``max_concurrency`` in flight.
Output lengths are pinned with ``max_tokens`` + ``ignore_eos`` so runs are
comparable; the server's ``usage`` (if it reports one) is the token count of
record, otherwise the number of streamed chunks.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence

import aiohttp

from tokenloom.bench.config import ServeConfig
from tokenloom.bench.datasets import BenchRequest
from tokenloom.bench.stats import BenchMetrics, RequestResult, compute_metrics


def _payload(
    cfg: ServeConfig, model: str, req: BenchRequest, decode: Callable[[list[int]], str] | None
) -> dict:
    if cfg.prompt_as_text:
        if req.prompt is not None:
            prompt: str | list[int] = req.prompt
        elif decode is not None:
            prompt = decode(req.prompt_token_ids)
        else:
            raise ValueError("prompt_as_text needs a decode function for token-id prompts")
    else:
        prompt = req.prompt_token_ids
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict, prompt_len: int, t0: float
) -> RequestResult:
    """Send one streaming completion request and time every chunk of it."""
    result = RequestResult(success=False, prompt_len=prompt_len)
    start = time.perf_counter()
    result.start_time = start - t0
    last = start
    events = 0
    usage_tokens: int | None = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:500]
                    return result
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if events == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                events += 1
        result.e2e = last - start
        result.output_len = usage_tokens if usage_tokens is not None else events
        result.success = events > 0
        if not result.success:
            result.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


async def run_load(
    requests: Sequence[BenchRequest],
    cfg: ServeConfig,
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[list[RequestResult], float, str]:
    """Send every request per the arrival schedule; returns (results, duration, model)."""
    from tqdm.asyncio import tqdm

    url = cfg.base_url.rstrip("/") + cfg.endpoint
    rng = random.Random(cfg.seed)
    limit = cfg.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = cfg.model or await resolve_model(session, cfg.base_url)
        bodies = [_payload(cfg, model, r, decode) for r in requests]
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests")
        t0 = time.perf_counter()

        async def one(body: dict, req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await send_request(session, url, body, req.prompt_len, t0)
            else:
                async with sem:
                    res = await send_request(session, url, body, req.prompt_len, t0)
            bar.update(1)
            return res

        tasks = []
        for body, req in zip(bodies, requests, strict=True):
            tasks.append(asyncio.create_task(one(body, req)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration, model


def run_serve_benchmark(
    requests: Sequence[BenchRequest],
    cfg: ServeConfig,
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[BenchMetrics, list[RequestResult], str]:
    """Blocking wrapper: run the load and aggregate it."""
    results, duration, model = asyncio.run(run_load(requests, cfg, decode))
    return compute_metrics(results, duration), results, model


_SPEC_COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def scrape_spec_counters(base_url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from ``/metrics`` (None: unavailable)."""
    import httpx

    try:
        text = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals = dict.fromkeys(_SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0].removeprefix("tokenloom:").removesuffix("_total")
        if base in totals:
            totals[base] += float(value)
    return totals


def format_spec_decoding(before: dict[str, float], after: dict[str, float]) -> str | None:
    """Acceptance rate and mean acceptance length over the run (None: nothing drafted)."""
    drafts, tokens, accepted = (after[k] - before[k] for k in _SPEC_COUNTERS)
    if drafts <= 0:
        return None
    rate = accepted / tokens if tokens else 0.0
    return (
        f"Spec decode: acceptance rate {rate:.1%}, mean acceptance length "
        f"{1 + accepted / drafts:.2f} ({int(drafts)} drafts, {int(tokens)} draft tokens)"
    )
