"""Tool calls a client can trust, over HTTP against the fake engine.

Every returned call's arguments parse and validate against its function's
schema; a call cut by max_tokens is not returned and the reply says
``length``; ``parallel_tool_calls: false`` yields at most one call; the
stream reassembles to exactly the whole reply (``reply_utils``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app

from .fake_engine import FakeAsyncLLM
from .reply_utils import reply_whole_and_streamed
from .test_app_fake_engine import assert_error

FLIGHT = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "minLength": 3, "maxLength": 3},
        "destination": {"type": "string", "minLength": 3, "maxLength": 3},
    },
    "required": ["origin", "destination"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "book_flight", "parameters": FLIGHT}},
    {"type": "function", "function": {"name": "now"}},
]
CHAT = {"messages": [{"role": "user", "content": "fly"}], "tools": TOOLS, "max_tokens": 500}


def _hermes(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>\n"


GOOD = {"origin": "OSL", "destination": "CDG"}
GOOD2 = {"origin": "CDG", "destination": "JFK"}


@pytest.fixture
def engine() -> FakeAsyncLLM:
    engine = FakeAsyncLLM()
    engine.max_model_len = 4096
    return engine


async def _client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(build_app(engine, enable_auto_tool_choice=True)):
        yield c


async def test_four_required_calls_cut_by_max_tokens(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    """The reported case: the fourth call cut off is no call, and the reply says length."""
    call = json.dumps({"name": "book_flight", "parameters": GOOD}, separators=(",", ":"))
    engine.reply = "[" + ",".join([call] * 4) + "]"
    cut = len(engine.reply) - 12
    body = {**CHAT, "tool_choice": "required", "max_tokens": cut}
    content, _, calls, finish = await reply_whole_and_streamed(client, body)
    assert finish == "length" and content is None
    assert [(n, json.loads(a)) for n, a in calls] == [("book_flight", GOOD)] * 3
    # Whole, the same array is four calls and finishes with tool_calls.
    body["max_tokens"] = len(engine.reply)
    _, _, calls, finish = await reply_whole_and_streamed(client, body)
    assert finish == "tool_calls" and len(calls) == 4


async def test_named_call_cut_is_no_call(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    engine.reply = json.dumps(GOOD)
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}}
    assert await reply_whole_and_streamed(client, {**body, "max_tokens": 10}) == (
        None,
        None,
        [],
        "length",
    )
    _, _, calls, finish = await reply_whole_and_streamed(client, body)
    assert finish == "tool_calls" and [(n, json.loads(a)) for n, a in calls] == [
        ("book_flight", GOOD)
    ]


@pytest.mark.parametrize("streamed_cut", [20, 50, 80])
async def test_auto_call_cut_by_max_tokens(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, streamed_cut: int
) -> None:
    engine.reply = "Booking.\n" + _hermes("book_flight", GOOD)
    content, _, calls, finish = await reply_whole_and_streamed(
        client, {**CHAT, "max_tokens": streamed_cut}
    )
    assert finish == "length" and calls == []
    # What the model wrote stays visible as text.
    assert content == engine.reply[:streamed_cut].strip()


async def test_calls_that_do_not_hold_up_stay_text(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    bad_schema = _hermes("book_flight", {"origin": "Oslo", "destination": "CDG"})
    unknown = _hermes("cancel_flight", GOOD)
    broken = '<tool_call>{"name": "book_flight", "arguments": {"origin": "OSL",}}</tool_call>'
    engine.reply = bad_schema + unknown + broken + _hermes("book_flight", GOOD)
    content, _, calls, finish = await reply_whole_and_streamed(client, CHAT)
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("book_flight", GOOD)]
    assert content is not None
    assert '"Oslo"' in content and "cancel_flight" in content and '"OSL",}' in content
    # Nothing valid: plain text, finished by itself.
    engine.reply = bad_schema
    assert await reply_whole_and_streamed(client, CHAT) == (bad_schema.strip(), None, [], "stop")


@pytest.mark.parametrize("parallel", [True, False])
async def test_parallel_tool_calls(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, parallel: bool
) -> None:
    engine.reply = _hermes("book_flight", GOOD) + _hermes("now", {}) + _hermes("book_flight", GOOD2)
    body = {**CHAT, "parallel_tool_calls": parallel}
    _, _, calls, finish = await reply_whole_and_streamed(client, body)
    assert finish == "tool_calls"
    expected = [("book_flight", GOOD), ("now", {}), ("book_flight", GOOD2)]
    assert [(n, json.loads(a)) for n, a in calls] == (expected if parallel else expected[:1])


async def test_auto_needs_enable_auto_tool_choice(engine: FakeAsyncLLM) -> None:
    async for client in _client(build_app(engine)):
        r = await client.post("/v1/chat/completions", json=CHAT)
        error = assert_error(r, 400, "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"]
        # Forced calls and no calls need no flag.
        engine.reply = json.dumps(GOOD)
        named = {"type": "function", "function": {"name": "book_flight"}}
        r = await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": named})
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})
        assert r.status_code == 200
    assert len(engine.started) == 2  # the refused request never reached the engine


async def test_a_tool_schema_that_is_not_a_schema_is_400(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    r = await client.post("/v1/chat/completions", json={**CHAT, "tools": tools})
    assert "not a valid JSON schema" in assert_error(r, 400, "tools")["message"]
    assert engine.started == []
