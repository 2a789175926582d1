"""The live dashboard: ``/dashboard``, its static files, and the stream that feeds it.

The page and its files (``dashboard_static/``, with uPlot vendored under
``vendor/``) hold no data and load with no network at run time. The data
comes from ``/dashboard/events``, a server-sent event stream of
``DashboardFeed.snapshot()`` every ``interval`` seconds, and
``/dashboard/state``, one snapshot. The feed is a stat logger, filled by the
engine's per-step stats as they arrive; nothing here asks the scheduler.

The data routes are ordinary routes, guarded by whatever guards the server's
others. The page and its static files hold no data, and a browser cannot
send a header when it navigates, so ``is_public_path`` names them for a key
check to leave open; the page sends the key it asks for as
``Authorization: Bearer`` on its data requests.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from tokenloom.metrics.dashboard import DashboardFeed

from .errors import OpenAIError

STATIC_DIR = Path(__file__).parent / "dashboard_static"
PAGE = "/dashboard"
STATIC = "/dashboard/static"
DEFAULT_INTERVAL_S = 1.0
_MIN_INTERVAL_S = 0.1
_MAX_INTERVAL_S = 60.0

_encoder = msgspec.json.Encoder()


def is_public_path(path: str) -> bool:
    """The page and its static files: no data, so no API key (the data routes need one)."""
    return path == PAGE or path.startswith(STATIC + "/")


def _interval(value: str | None) -> float:
    if value is None:
        return DEFAULT_INTERVAL_S
    try:
        interval = float(value)
    except ValueError:
        interval = math.nan
    if not _MIN_INTERVAL_S <= interval <= _MAX_INTERVAL_S:
        raise OpenAIError(
            f"interval must be a number of seconds in [{_MIN_INTERVAL_S}, {_MAX_INTERVAL_S}], "
            f"got {value!r}",
            param="interval",
        )
    return interval


def add_dashboard_routes(app: FastAPI, feed: DashboardFeed) -> None:
    """Serve the dashboard of ``feed`` on ``app``."""

    @app.get(PAGE, include_in_schema=False)
    async def dashboard_page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(STATIC, StaticFiles(directory=STATIC_DIR), name="dashboard_static")

    @app.get(PAGE + "/state", include_in_schema=False)
    async def dashboard_state() -> Response:
        feed.tick()
        return Response(_encoder.encode(feed.snapshot()), media_type="application/json")

    @app.get(PAGE + "/events", include_in_schema=False)
    async def dashboard_events(raw_request: Request) -> Response:
        interval = _interval(raw_request.query_params.get("interval"))
        return StreamingResponse(
            _events(feed, raw_request, interval),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _events(
    feed: DashboardFeed, raw_request: Request, interval: float
) -> AsyncIterator[bytes]:
    """A snapshot every ``interval`` seconds until the client goes away."""
    while not await raw_request.is_disconnected():
        feed.tick()
        yield b"data: " + _encoder.encode(feed.snapshot()) + b"\n\n"
        await asyncio.sleep(interval)
