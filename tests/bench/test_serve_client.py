"""The serving load generator against a tiny fake OpenAI-compatible streaming server.

The server here is a stub: these tests check the CLIENT (request bodies,
stream parsing, token timing, concurrency cap, failures), not an engine.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from aiohttp import web

from tokenloom.bench.datasets import BenchRequest
from tokenloom.bench.serve import ServeConfig, run_load
from tokenloom.bench.stats import compute_metrics

TOKEN_DELAY = 0.01


class FakeServer:
    def __init__(self, report_usage: bool = True) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.report_usage = report_usage

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["prompt"] == [666]:
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(TOKEN_DELAY * 3)  # "prefill"
            for i in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(TOKEN_DELAY)
            if self.report_usage:
                usage = {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": body["max_tokens"],
                }
                await resp.write(
                    f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                )
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp


async def start(fake: FakeServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


REQUESTS = [BenchRequest([10 + i] * (5 + i), max_tokens=3 + i) for i in range(6)]


@pytest.mark.timeout(30)
async def test_streams_and_times_every_token():
    fake = FakeServer()
    runner, url = await start(fake)
    try:
        results, duration, model = await run_load(
            REQUESTS, ServeConfig(base_url=url, disable_tqdm=True)
        )
    finally:
        await runner.cleanup()
    assert model == "fake-model"
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [3, 4, 5, 6, 7, 8]
    for req, r in zip(REQUESTS, results, strict=True):
        assert r.prompt_len == len(req.prompt_token_ids)
        assert len(r.itl) == req.max_tokens - 1
        assert r.ttft >= TOKEN_DELAY * 3 * 0.9
        assert r.e2e >= r.ttft + sum(r.itl) - 1e-6
        assert all(x > 0 for x in r.itl)
    # The request bodies: token-id prompts, greedy, fixed length.
    by_prompt = {tuple(b["prompt"]): b for b in fake.bodies}
    for req in REQUESTS:
        b = by_prompt[tuple(req.prompt_token_ids)]
        assert b["model"] == "fake-model" and b["stream"] is True
        assert b["max_tokens"] == req.max_tokens and b["temperature"] == 0.0
        assert b["ignore_eos"] is True
    assert fake.max_in_flight == len(REQUESTS)  # rate inf: all at once
    m = compute_metrics(results, duration)
    assert m.total_output_tokens == sum(r.max_tokens for r in REQUESTS)
    assert m.tpot.mean == pytest.approx(TOKEN_DELAY, rel=0.9)


@pytest.mark.timeout(30)
async def test_max_concurrency_and_counting_without_usage():
    fake = FakeServer(report_usage=False)
    runner, url = await start(fake)
    cfg = ServeConfig(
        base_url=url, model="m", max_concurrency=2, ignore_eos=False, disable_tqdm=True
    )
    try:
        results, _, model = await run_load(REQUESTS, cfg)
    finally:
        await runner.cleanup()
    assert model == "m"
    assert fake.max_in_flight == 2
    assert [r.output_len for r in results] == [r.max_tokens for r in REQUESTS]  # counted chunks
    assert all("ignore_eos" not in b for b in fake.bodies)


@pytest.mark.timeout(30)
async def test_poisson_arrivals_spread_out_and_failures_are_reported():
    fake = FakeServer()
    runner, url = await start(fake)
    reqs = [BenchRequest([5], 2) for _ in range(8)] + [BenchRequest([666], 2)]
    cfg = ServeConfig(base_url=url, request_rate=40.0, seed=1, disable_tqdm=True)
    try:
        results, duration, _ = await run_load(reqs, cfg)
    finally:
        await runner.cleanup()
    starts = [r.start_time for r in results]
    assert starts == sorted(starts) and starts[-1] > 0.02  # not all at t=0
    assert not results[-1].success and "HTTP 400" in results[-1].error
    m = compute_metrics(results, duration)
    assert (m.completed, m.failed) == (8, 1)


def test_config_validation():
    with pytest.raises(ValueError, match="request_rate"):
        ServeConfig(request_rate=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        ServeConfig(max_concurrency=0)
    assert math.isinf(ServeConfig().request_rate)
