"""A chat reply fetched whole and streamed, with the stream reassembled: they must agree."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

# What the tests compare: content, reasoning, calls as (name, arguments), finish reason.
Reply = tuple[str | None, str | None, list[tuple[str, str]], str | None]


def _from_message(message: dict[str, Any], finish: str | None) -> Reply:
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    return message.get("content"), message.get("reasoning_content"), calls, finish


def _from_deltas(deltas: list[tuple[dict[str, Any], str | None]]) -> Reply:
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for delta, finish_reason in deltas:
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for part in delta.get("tool_calls") or []:
            function = part.get("function") or {}
            if part.get("id") is not None:
                assert part["index"] == len(calls) and part["type"] == "function"
                assert part["id"] not in {c[2] for c in calls.values()}
                calls[part["index"]] = [function["name"], "", part["id"]]
            calls[part["index"]][1] += function.get("arguments") or ""
        finish = finish_reason or finish
    ordered = [(name, args) for name, args, _ in calls.values()]
    return content or None, reasoning or None, ordered, finish


async def reply_whole_and_streamed(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    """POST the chat ``body`` twice (whole, streamed); assert both say the same; return it."""
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    whole = _from_message(choice["message"], choice["finish_reason"])
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    deltas = []
    for block in r.text.strip().split("\n\n"):
        data = block.removeprefix("data: ")
        if data != "[DONE]":
            event = json.loads(data)
            assert "error" not in event, event
            deltas += [(c["delta"], c["finish_reason"]) for c in event["choices"]]
    assert _from_deltas(deltas) == whole
    return whole


def openai_reply_whole_and_streamed(client: openai.OpenAI, **kwargs: Any) -> Reply:
    """The same through the official client."""
    completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    whole = _from_message(choice.message.model_dump(), choice.finish_reason)
    deltas = [
        (c.delta.model_dump(exclude_none=True), c.finish_reason)
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for c in chunk.choices
    ]
    assert _from_deltas(deltas) == whole
    return whole
