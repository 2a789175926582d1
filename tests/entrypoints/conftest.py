"""Fixtures of the app over the model-free fake engine (a module may define its own)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app

from .fake_engine import FakeAsyncLLM


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    """The app of ``engine`` with every default, reached in process."""
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
