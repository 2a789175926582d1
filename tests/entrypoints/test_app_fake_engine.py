"""The HTTP layer against a model-free fake engine: formats, SSE framing, error mapping."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app, default_served_model_name

from .fake_engine import FakeAsyncLLM


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, max_waiting_requests=2)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def events(body: str) -> list[Any]:
    """Decode an SSE body; the final [DONE] marker is returned as the string itself."""
    out: list[Any] = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert error["param"] == param
    assert error["message"]
    return error


async def test_completion_body_and_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 3, "n": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "fake-model"
    assert [c["text"] for c in body["choices"]] == ["abc", "bcd"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


async def test_batch_of_prompts_indexes_choices_per_prompt(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": ["p", "xy"], "max_tokens": 1, "n": 2, "echo": True}
    )
    texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert texts == {0: "pa", 1: "pb", 2: "xya", 3: "xyb"}


async def test_completion_logprobs_object(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"] == [{"a": -0.5}, {"b": -0.5}]
    assert logprobs["text_offset"] == [0, 1]


async def test_completion_stream_with_usage(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    texts = [c["choices"][0]["text"] for c in chunks[:-2]]
    assert "".join(texts) == "abc"
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-2])


async def test_chat_stream_sends_role_first(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
    )
    chunks = events(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert "usage" not in chunks[0]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-1])
    assert content == "ab"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1] == "[DONE]"


async def test_chat_body_and_logprobs(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "a"}
    entry = choice["logprobs"]["content"][0]
    assert entry["token"] == "a" and entry["logprob"] == -0.5 and entry["bytes"] == [97]
    assert [t["token"] for t in entry["top_logprobs"]] == ["a", "b"]
    # The prompt went through the chat template.
    assert body["usage"]["prompt_tokens"] == len("user: hi\nassistant:")


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "model": "other"}, "model"),
        ({"prompt": "x" * 100}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 1}, "prompt"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ],
)
async def test_completion_bad_inputs(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, payload: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/completions", json=payload)
    assert_error(r, 400, param)
    assert engine.finished == []


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
    ],
)
async def test_chat_bad_inputs(
    client: httpx.AsyncClient, payload: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **payload}
    assert_error(await client.post("/v1/chat/completions", json=body), 400, param)


async def test_invalid_json_and_non_object(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", content=b"{not json")
    assert "JSON" in assert_error(r, 400, None)["message"]
    assert_error(await client.post("/v1/completions", json=[1, 2]), 400, None)


async def test_waiting_limit_gives_503(client: httpx.AsyncClient) -> None:
    # The limit (2) counts prompts that have no output yet, batch entries included.
    r = await client.post("/v1/completions", json={"prompt": ["x", "y", "z"], "max_tokens": 1})
    assert_error(r, 503, None)
    r = await client.post("/v1/completions", json={"prompt": ["x", "y"], "max_tokens": 1})
    assert r.status_code == 200


async def test_dead_engine(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    assert (await client.get("/health")).status_code == 200
    engine.errored = True
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code >= 500


async def test_engine_dying_mid_stream_ends_with_error_event() -> None:
    engine = FakeAsyncLLM(step_delay=0.01)
    app = build_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def kill_soon() -> None:
            await asyncio.sleep(0.05)
            engine.errored = True

        killer = asyncio.create_task(kill_soon())
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 60, "stream": True}
        )
        await killer
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["error"]["code"] == 500
    assert engine.closed == engine.started


async def test_models_version_metrics(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["max_model_len"] == 64
    assert (await client.get("/version")).json()["version"]
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert_error(await client.get("/no/such/route"), 404, None)


def test_default_served_model_name() -> None:
    assert default_served_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_served_model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert default_served_model_name("/models/Qwen2-0.5B/") == "Qwen2-0.5B"


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_closes_the_engine_request(stream: bool) -> None:
    """A client leaving mid-generation must stop the engine request (no finished output)."""
    engine = FakeAsyncLLM(step_delay=0.02)
    app = build_app(engine)
    body = json.dumps({"prompt": "x", "max_tokens": 50, "stream": stream}).encode()
    body_sent = False
    disconnect = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    for _ in range(200):
        if engine.started:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # a few steps in
    disconnect.set()
    await asyncio.wait_for(task, 5)
    assert engine.started and engine.closed == engine.started
    assert engine.finished == []
    assert engine.num_running_requests == 0


async def test_streamed_batch_interleaves_prompts(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={"prompt": ["x", "yy"], "max_tokens": 3, "n": 2, "stream": True, "echo": True},
    )
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "xabc", 1: "xbcd", 2: "yyabc", 3: "yybcd"}
    assert finished == {i: "length" for i in range(4)}


# ------------------------------------------------------------------ chat rendering


async def test_chat_options_come_from_the_request(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "I"}],
            "max_tokens": 1,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert r.status_code == 200, r.text
    [options] = engine.chat_options
    assert options.add_generation_prompt is False and options.continue_final_message is True
    assert options.chat_template is None
    assert options.chat_template_kwargs == {"enable_thinking": False}
    assert r.json()["usage"]["prompt_tokens"] == len("user: hi\nassistant: I\n")


async def test_messages_keep_their_extra_keys(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]
    r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    [conversation] = engine.conversations
    assert conversation[0] == {"role": "user", "content": "ab"}
    assert conversation[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert conversation[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}


@pytest.mark.parametrize(
    "fields",
    [{"chat_template": "{{ messages }}"}, {"chat_template_kwargs": {"chat_template": "x"}}],
)
async def test_request_chat_template_needs_trust(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, fields: dict[str, Any]
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    error = assert_error(
        await client.post("/v1/chat/completions", json=body), 400, next(iter(fields))
    )
    assert "--trust-request-chat-template" in error["message"]
    assert engine.rendered == []


async def test_trusted_request_chat_template_is_used() -> None:
    engine = FakeAsyncLLM()
    app = build_app(engine, trust_request_chat_template=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
        r = await client.post("/v1/chat/completions", json={**body, "chat_template": template})
        assert r.status_code == 200, r.text
        assert engine.rendered[-1].text == "<hi>"
        # The engine's ValueErrors name the field they blame.
        broken = {**body, "chat_template": "{% for %}"}
        assert_error(await client.post("/v1/chat/completions", json=broken), 400, "chat_template")
        reserved = {**body, "chat_template_kwargs": {"messages": []}}
        r = await client.post("/v1/chat/completions", json=reserved)
        assert_error(r, 400, "chat_template_kwargs")
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
