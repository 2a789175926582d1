"""Requests a careless or hostile client can send: each gets a 4xx OpenAI error body
naming the field, and the server goes on serving the next request.

All against the model-free fake engine; bodies are written by hand where
``json=`` could not express them (NaN, lone surrogates, deep nesting).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app
from tokenloom.sampling_params import SamplingParams

from .fake_engine import FakeAsyncLLM

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Every float sampling parameter, read from the dataclass so a new one is covered too.
FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.type == "float")
NON_FINITE = ("NaN", "Infinity", "-Infinity")
LIMIT = 512 * 1024  # --max-request-bytes of the app under test


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, max_request_bytes=LIMIT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"max_tokens": 2}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return {**base, **fields}


def raw_body(path: str, **raw_fields: str) -> bytes:
    """A body whose ``raw_fields`` are pasted in as JSON text, verbatim."""
    text = json.dumps(body_for(path))[:-1]
    for name, raw in raw_fields.items():
        text += f', "{name}": {raw}'
    return (text + "}").encode()


async def rejected(
    client: httpx.AsyncClient,
    path: str,
    *,
    status: int = 400,
    param: str | None,
    json_body: dict[str, Any] | None = None,
    content: bytes | None = None,
) -> dict[str, Any]:
    """Send one bad request, check its error body, then check a good one still works."""
    if content is not None:
        headers = {"content-type": "application/json"}
        response = await client.post(path, content=content, headers=headers)
    else:
        response = await client.post(path, json=json_body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    assert error["param"] == param, error
    await still_serving(client, path)
    return error


async def still_serving(client: httpx.AsyncClient, path: str) -> None:
    ok = await client.post(path, json=body_for(path))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"]


# ------------------------------------------------------------ 500s turned into 400s


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
async def test_seed_beyond_64_bits(client: httpx.AsyncClient, path: str, seed: int) -> None:
    await rejected(client, path, param="seed", json_body=body_for(path, seed=seed))


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
async def test_seed_at_the_64_bit_limits_is_accepted(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, seed: int
) -> None:
    r = await client.post(COMPLETIONS, json=body_for(COMPLETIONS, seed=seed))
    assert r.status_code == 200, r.text
    assert engine.params[-1].seed == seed


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETIONS, {"prompt": '"a\\ud800b"'}, "prompt"),
        (COMPLETIONS, {"prompt": '["ok", "\\udfff"]'}, "prompt[1]"),
        (COMPLETIONS, {"stop": '["\\ud83d"]'}, "stop[0]"),
        (COMPLETIONS, {"user": '"\\uDC00"'}, "user"),
        (CHAT, {"messages": '[{"role": "user", "content": "\\ud800"}]'}, "messages[0].content"),
        (
            CHAT,
            {"messages": '[{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]'},
            "messages[0].content[0].text",
        ),
        (CHAT, {"chat_template_kwargs": '{"\\ud800": 1}'}, "chat_template_kwargs.\ufffd"),
    ],
)
async def test_lone_surrogates(
    client: httpx.AsyncClient, path: str, raw: dict[str, str], param: str
) -> None:
    error = await rejected(client, path, param=param, content=raw_body(path, **raw))
    assert "surrogate" in error["message"]


async def test_surrogate_pairs_are_fine(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    r = await client.post(
        COMPLETIONS, content=raw_body(COMPLETIONS, prompt='"\\ud83d\\ude00"', echo="true")
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("\U0001f600")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("depth", [100, 100_000])
async def test_deeply_nested_json(client: httpx.AsyncClient, path: str, depth: int) -> None:
    nested = "[" * depth + "]" * depth
    error = await rejected(
        client, path, param="stop" if depth == 100 else None, content=raw_body(path, stop=nested)
    )
    assert "nested" in error["message"]


# ------------------------------------------------------- accepted although invalid


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", NON_FINITE)
async def test_non_finite_floats(
    client: httpx.AsyncClient, path: str, field: str, value: str
) -> None:
    await rejected(client, path, param=field, content=raw_body(path, **{field: value}))


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", ["max_tokens", "n", "top_k", "min_tokens"])
async def test_non_finite_for_integer_fields(
    client: httpx.AsyncClient, path: str, field: str
) -> None:
    await rejected(client, path, param=field, content=raw_body(path, **{field: "Infinity"}))


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"max_tokens": 10**30}, "max_tokens"),
        (COMPLETIONS, {"top_k": 2**63}, "top_k"),
        (COMPLETIONS, {"min_tokens": 2**63}, "min_tokens"),
        (COMPLETIONS, {"stop_token_ids": [2**70]}, "stop_token_ids"),
        (COMPLETIONS, {"priority": 2**63}, "priority"),
        (CHAT, {"max_completion_tokens": 10**30}, "max_completion_tokens"),
        (CHAT, {"priority": -(2**63) - 1}, "priority"),
    ],
)
async def test_integers_beyond_64_bits(
    client: httpx.AsyncClient, path: str, fields: dict[str, Any], param: str
) -> None:
    await rejected(client, path, param=param, json_body=body_for(path, **fields))


@pytest.mark.parametrize("top_logprobs", [21, 1000, -1])
async def test_chat_top_logprobs_is_0_to_20(client: httpx.AsyncClient, top_logprobs: int) -> None:
    body = body_for(CHAT, logprobs=True, top_logprobs=top_logprobs)
    await rejected(client, CHAT, param="top_logprobs", json_body=body)


async def test_chat_top_logprobs_20_is_accepted(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json=body_for(CHAT, logprobs=True, top_logprobs=20))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("logprobs", [21, 100])
async def test_completion_logprobs_capped_by_max_logprobs(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, logprobs: int
) -> None:
    body = body_for(COMPLETIONS, logprobs=logprobs)
    error = await rejected(client, COMPLETIONS, param="logprobs", json_body=body)
    assert "max-logprobs" in error["message"]
    r = await client.post(COMPLETIONS, json=body_for(COMPLETIONS, logprobs=20))
    assert r.status_code == 200, r.text


async def test_engine_logprobs_error_names_top_logprobs_for_chat(
    engine: FakeAsyncLLM, client: httpx.AsyncClient
) -> None:
    engine.max_logprobs = 5  # as if served with --max-logprobs 5
    body = body_for(CHAT, logprobs=True, top_logprobs=6)
    await rejected(client, CHAT, param="top_logprobs", json_body=body)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("n", [129, 100_000])
async def test_n_is_capped_at_128(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, path: str, n: int
) -> None:
    await rejected(client, path, param="n", json_body=body_for(path, n=n))
    assert all(p.n <= 128 for p in engine.params)


async def test_n_128_is_accepted(client: httpx.AsyncClient) -> None:
    r = await client.post(COMPLETIONS, json=body_for(COMPLETIONS, n=128, max_tokens=1))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 128


@pytest.mark.parametrize("role", ["wizard", "", "USER", 5])
async def test_unknown_roles(client: httpx.AsyncClient, role: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    await rejected(
        client, CHAT, param="messages[1].role", json_body=body_for(CHAT, messages=messages)
    )


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
async def test_known_roles(client: httpx.AsyncClient, engine: FakeAsyncLLM, role: str) -> None:
    messages = [{"role": role, "content": "x"}, {"role": "user", "content": "hi"}]
    r = await client.post(CHAT, json=body_for(CHAT, messages=messages))
    assert r.status_code == 200, r.text
    assert engine.rendered[-1].text.startswith(f"{role}: x\n")


# ------------------------------------------------------------------ body size


async def test_body_over_the_limit_by_content_length(client: httpx.AsyncClient) -> None:
    big = body_for(COMPLETIONS, prompt="x" * LIMIT)
    error = await rejected(client, COMPLETIONS, status=413, param=None, json_body=big)
    assert "--max-request-bytes" in error["message"]


async def test_chunked_body_over_the_limit(client: httpx.AsyncClient) -> None:
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(1000):  # 1000 x 1 KiB, over the 512 KiB limit
            sent += 1
            yield b"x" * 1024
        yield b'"}'

    r = await client.post(COMPLETIONS, content=chunks())
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == 413
    assert sent < 1000  # refused while the upload was still coming in
    await still_serving(client, COMPLETIONS)


async def test_body_under_the_limit_is_read_whole(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x"
        yield b'", "max_tokens": 2}'

    r = await client.post(COMPLETIONS, content=chunks())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 10


# ------------------------------------------------------------- the rest of the API


async def test_echo_of_token_ids_is_decoded(client: httpx.AsyncClient) -> None:
    r = await client.post(
        COMPLETIONS, json={"prompt": [104, 105, 0xD800], "max_tokens": 1, "echo": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hi\ufffda"


async def test_token_ids_outside_the_vocabulary(client: httpx.AsyncClient) -> None:
    for prompt in ([-1], [2**70], [[1], [0x110000]]):
        await rejected(
            client, COMPLETIONS, param="prompt", json_body=body_for(COMPLETIONS, prompt=prompt)
        )


async def test_prompt_batches_are_bounded(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    body = body_for(COMPLETIONS, prompt=["a"] * 100_000)
    error = await rejected(client, COMPLETIONS, param="prompt", json_body=body)
    assert "2048" in error["message"]
    body = body_for(COMPLETIONS, prompt=["a"] * 17, n=128)  # 2176 completions
    await rejected(client, COMPLETIONS, param="prompt", json_body=body)
    assert len(engine.started) == 2  # only the two checks that the server still serves
    r = await client.post(COMPLETIONS, json=body_for(COMPLETIONS, prompt=["a"] * 16, n=128))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2048


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("field", "value"), [("stop", ["x"] * 129), ("stop_token_ids", list(range(1025)))]
)
async def test_stop_lists_are_bounded(
    client: httpx.AsyncClient, path: str, field: str, value: list[Any]
) -> None:
    # Every generated token is checked against each of them.
    await rejected(client, path, param=field, json_body=body_for(path, **{field: value}))
    ok = await client.post(path, json=body_for(path, **{field: value[:-1]}))
    assert ok.status_code == 200, ok.text
