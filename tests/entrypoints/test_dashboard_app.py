"""The dashboard's routes on the app, over a model-free fake engine."""

from __future__ import annotations

import json

import httpx

from tokenloom.entrypoints.openai import dashboard
from tokenloom.entrypoints.openai.server import build_app
from tokenloom.metrics.dashboard import DashboardFeed
from tokenloom.metrics.stats import IterationStats
from tokenloom.outputs import SchedulerStats

from .fake_engine import FakeAsyncLLM


def feed_of(engine: FakeAsyncLLM) -> DashboardFeed:
    [feed] = [s for s in engine.stat_loggers if isinstance(s, DashboardFeed)]
    return feed


async def test_the_page_and_its_files_are_served(client: httpx.AsyncClient) -> None:
    page = await client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "dashboard/static/dashboard.js" in page.text
    for path in (
        "dashboard.js",
        "dashboard.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
    ):
        r = await client.get(f"/dashboard/static/{path}")
        assert r.status_code == 200 and len(r.content) > 1000, path
    assert (await client.get("/dashboard/static/nothing.js")).status_code == 404


async def test_state_follows_the_engine_stats(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    feed_of(engine).record(
        SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5),
        IterationStats(num_generation_tokens=7),
    )
    state = (await client.get("/dashboard/state")).json()
    assert state["model"] == "fake-model"
    assert (state["running"], state["waiting"]) == (3, 1)
    assert state["totals"]["generation_tokens"] == 7
    assert state["engines"][0]["kv_cache_usage"] == 0.5


async def test_event_stream_sends_snapshots_until_the_client_goes(engine: FakeAsyncLLM) -> None:
    feed = DashboardFeed("m")
    feed.record(SchedulerStats(num_running_reqs=2), None)
    checks = iter([False, False, True])

    class Client:
        async def is_disconnected(self) -> bool:
            return next(checks)

    events = [e async for e in dashboard._events(feed, Client(), 0.0)]  # type: ignore[arg-type]
    assert len(events) == 2
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:])["running"] == 2


async def test_interval_is_checked_and_routes_stay_out_of_the_schema(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/dashboard/events", params={"interval": "0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"
    schema = (await client.get("/openapi.json")).json()
    assert not [p for p in schema["paths"] if p.startswith("/dashboard")]


async def test_no_dashboard_when_switched_off(engine: FakeAsyncLLM) -> None:
    transport = httpx.ASGITransport(app=build_app(engine, dashboard=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert (await c.get("/dashboard")).status_code == 404
    assert not [s for s in engine.stat_loggers if isinstance(s, DashboardFeed)]


def test_only_the_page_and_static_files_are_public() -> None:
    assert dashboard.is_public_path("/dashboard")
    assert dashboard.is_public_path("/dashboard/static/dashboard.js")
    assert not dashboard.is_public_path("/dashboard/events")
    assert not dashboard.is_public_path("/dashboard/state")
    assert not dashboard.is_public_path("/dashboard/static")


async def test_trace_headers_reach_the_engine(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    r = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "ab", "max_tokens": 2},
        headers={"traceparent": traceparent},
    )
    assert r.status_code == 200
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200
    assert engine.trace_headers == [{"traceparent": traceparent}, None]
